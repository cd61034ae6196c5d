"""Subprocess helpers for the disk tier's writer-flood tests (tests/store/test_store_demotion.py).

    python tests/helpers/flood_worker.py flood CONFIG_JSON PREFIX N SIZE BATCH
        Build N payloads of SIZE bytes (keys PREFIX/0..N-1, one prefix chain), print
        "ready", wait for a line on stdin, put them in batches of BATCH as fast as the
        store takes them, then print {"codes": [...], "seconds": s} (one code per key).
    python tests/helpers/flood_worker.py gated-coordinator CONFIG_JSON GATE
        Run a coordinator in the foreground whose disk writes each wait until the file
        GATE exists: the test decides when demotion makes progress.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from kvcentric.store import open_store  # noqa: E402
from tests.helpers.payload import payload  # noqa: E402

GATE_WAIT_S = 600.0  # a gated write waits for the test's gate file at most this long


def flood(cfg: str, prefix: str, n: int, size: int, batch: int) -> None:
    keys = [f"{prefix}/{i}" for i in range(n)]
    data = [payload(k, size) for k in keys]
    store = open_store(json.loads(cfg))
    print("ready", flush=True)
    sys.stdin.readline()
    codes: list[int] = []
    t0 = time.monotonic()
    for i in range(0, n, batch):
        ks = keys[i:i + batch]
        parents = [keys[i - 1] if i else None, *ks[:-1]]
        codes += store.batch_put_from(ks, [d.ctypes.data for d in data[i:i + batch]],
                                      [size] * len(ks), parents)
    print(json.dumps({"codes": codes, "seconds": time.monotonic() - t0}), flush=True)
    store.close()


def gated_coordinator(cfg: str, gate: Path) -> None:
    from kvcentric.store.local import demoter, server

    class GatedWorker(demoter.DiskWorker):
        def _write_batch(self, jobs: list[demoter.WriteJob]) -> None:
            deadline = time.monotonic() + GATE_WAIT_S
            while not gate.exists():  # only this I/O thread waits; the loop runs on
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test never opened {gate}")
                time.sleep(0.005)
            super()._write_batch(jobs)

    server.DiskWorker = GatedWorker  # type: ignore[misc]
    server.main(["--config-json", cfg])


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "flood":
        flood(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    elif mode == "gated-coordinator":
        gated_coordinator(args[0], Path(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
