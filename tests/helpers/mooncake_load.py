"""Steady put/get load on a store for fault tests; prints one JSON summary at the end.

    python tests/helpers/mooncake_load.py CONFIG_JSON SECONDS

Every round puts 4 new objects and reads back 4 random earlier ones, verifying each byte,
and prints ``ok`` or ``fail`` (any put refused) on a line of its own, so a test can wait
for the load's own evidence (steady, outage seen, recovered) instead of for a time. It
runs until its stdin is closed (EOF) or SECONDS have passed, whichever comes first.
Reported: how many calls each outcome had, the slowest call, the time of the last failed
and of the first successful round after a failure (so a test sees outage and recovery),
and ``bad``: reads that returned wrong bytes (must stay 0, whatever the store does).
"""

from __future__ import annotations

import json
import random
import select
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from kvcentric.store import OK, open_store  # noqa: E402
from tests.helpers.payload import payload, size_of  # noqa: E402


def _stdin_closed() -> bool:
    """True once the test closed our stdin (readable and at EOF)."""
    return bool(select.select([sys.stdin], [], [], 0)[0]) and sys.stdin.read(1) == ""


def main() -> None:
    cfg, seconds = json.loads(sys.argv[1]), float(sys.argv[2])
    store = open_store(cfg)
    rnd = random.Random(0)
    codes: dict[str, int] = {}
    stored: list[str] = []
    bad, slowest, t_start = 0, 0.0, time.monotonic()
    last_fail = first_ok_after_fail = None
    arena = np.empty(4 << 20, np.uint8)
    store.register_buffer(arena.ctypes.data, arena.nbytes)
    print("ready", flush=True)
    i = 0
    while time.monotonic() - t_start < seconds and not _stdin_closed():
        keys = [f"load/{i}/{j}" for j in range(4)]
        i += 1
        data = [payload(k, size_of(k)) for k in keys]
        t0 = time.monotonic()
        put = store.batch_put_from(keys, [d.ctypes.data for d in data], [d.nbytes for d in data])
        slowest = max(slowest, time.monotonic() - t0)
        stored += [k for k, c in zip(keys, put) if c == OK]
        reads = rnd.sample(stored, min(4, len(stored)))
        offs = np.cumsum([0] + [size_of(k) for k in reads])
        t0 = time.monotonic()
        got = store.batch_get_into(reads, [arena.ctypes.data + int(o) for o in offs[:-1]],
                                   [size_of(k) for k in reads])
        slowest = max(slowest, time.monotonic() - t0)
        for k, g, o in zip(reads, got, offs):
            if g >= 0 and not np.array_equal(arena[o:o + g], payload(k, size_of(k))[:g]):
                bad += 1
        for c in put + got:
            name = "ok" if c >= 0 else str(c)
            codes[name] = codes.get(name, 0) + 1
        now = time.monotonic() - t_start
        if any(c < 0 for c in put):
            last_fail, first_ok_after_fail = now, None
        elif last_fail is not None and first_ok_after_fail is None:
            first_ok_after_fail = now
        print("fail" if any(c < 0 for c in put) else "ok", flush=True)
        time.sleep(0.02)  # not-sync: the load's pace, a round every 20 ms at most
    print(json.dumps({"codes": codes, "bad": bad, "slowest_s": slowest, "rounds": i,
                      "last_fail_s": last_fail, "first_ok_after_fail_s": first_ok_after_fail}))
    store.close()


if __name__ == "__main__":
    main()
