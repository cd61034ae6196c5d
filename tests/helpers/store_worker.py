"""Subprocess worker for multi-process store tests.

    python tests/helpers/store_worker.py CONFIG_JSON MODE [ARGS...]

Modes:
  put KEY...        put each key's payload, print codes as JSON
  get KEY...        get each key, verify bytes, print {"got": n, "bad": m}
  hold-write KEY    reserve a slot, write half of it, print "ready", sleep (to be killed)
  hold-read KEY     lease KEY, print "ready", sleep (to be killed)
  stress SECONDS SEED   put/get/verify/remove random chains until the deadline
"""

from __future__ import annotations

import ctypes
import json
import random
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from kvcentric.store import ERR_NO_SPACE, OK, open_store  # noqa: E402
from tests.helpers.payload import payload, size_of  # noqa: E402


def check(store, keys: list[str]) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    bufs = [np.empty(size_of(k), np.uint8) for k in keys]
    got = store.batch_get_into(keys, [b.ctypes.data for b in bufs], [b.nbytes for b in bufs])
    n = bad = 0
    for k, b, g in zip(keys, bufs, got):
        if g < 0:
            continue
        n += 1
        if g != b.nbytes or not np.array_equal(b, payload(k, b.nbytes)):
            bad += 1
    return n, bad


def stress(store, seconds: float, seed: int) -> dict:  # type: ignore[no-untyped-def]
    rnd = random.Random(seed)
    cache: dict[str, np.ndarray] = {}
    stats = {"puts": 0, "no_space": 0, "gets": 0, "bad": 0, "in_place": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        c, n = rnd.randrange(48), rnd.randint(1, 6)
        keys = [f"s/{c}/{j}" for j in range(n)]
        for k in keys:
            if k not in cache:
                cache[k] = payload(k, size_of(k))
        codes = store.batch_put_from(keys, [cache[k].ctypes.data for k in keys],
                                     [cache[k].nbytes for k in keys], [None] + keys[:-1])
        stats["puts"] += codes.count(OK)
        stats["no_space"] += codes.count(ERR_NO_SPACE)
        assert all(x in (OK, ERR_NO_SPACE) for x in codes), codes
        got, bad = check(store, [f"s/{rnd.randrange(48)}/{j}" for j in range(6)])
        stats["gets"] += got
        stats["bad"] += bad
        if rnd.random() < 0.2:
            stats["bad"] += verify_in_place(store, keys)
            stats["in_place"] += 1
        if rnd.random() < 0.05:
            store.remove(keys[-1])
    return stats


def verify_in_place(store, keys: list[str]) -> int:  # type: ignore[no-untyped-def]
    lease = store.batch_acquire(keys, [size_of(k) for k in keys])
    try:
        bad = 0
        for k, p, s in zip(lease.keys, lease.ptrs, lease.sizes):
            view = np.ctypeslib.as_array((ctypes.c_uint8 * s).from_address(p))
            bad += int(not np.array_equal(view, payload(k, s)))
        return bad
    finally:
        store.release(lease)


def main() -> None:
    cfg, mode, args = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
    store = open_store(cfg)
    if mode == "put":
        data = [payload(k, size_of(k)) for k in args]
        print(json.dumps(store.batch_put_from(args, [d.ctypes.data for d in data],
                                              [d.nbytes for d in data])))
    elif mode == "get":
        got, bad = check(store, args)
        print(json.dumps({"got": got, "bad": bad}))
    elif mode == "hold-write":
        (slot,) = store.batch_alloc(args, [size_of(args[0])])
        ctypes.memset(slot.ptr, 0xAB, slot.size // 2)
        print("ready", flush=True)
        time.sleep(600)  # not-sync: a writer that hangs holding its slot, until killed
    elif mode == "hold-read":
        store.batch_acquire(args, [size_of(args[0])])
        print("ready", flush=True)
        time.sleep(600)  # not-sync: a reader that hangs holding its lease, until killed
    elif mode == "stress":
        print(json.dumps(stress(store, float(args[0]), int(args[1]))))
    store.close()


if __name__ == "__main__":
    main()
