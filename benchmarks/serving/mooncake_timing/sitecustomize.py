"""Time every Mooncake store call a process makes, whichever connector makes it.

``python -m benchmarks.serving.connectors --profile-calls`` puts this directory first on
``PYTHONPATH`` of the vLLM server it starts and sets ``KVC_MOONCAKE_TIMING`` to a
directory; Python imports this module at start-up in every process of that server (API
server, engine core, workers). It wraps the data-moving and lookup methods of
``mooncake.store.MooncakeDistributedStore`` -- the class both vLLM's
MooncakeStoreConnector and our Mooncake backend call -- so both connectors are timed at
the same boundary, and writes ``<dir>/<pid>.json`` ({method: [calls, seconds]}) every
second and at exit. Benchmark-only: nothing in the package imports it.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

_DIR = os.environ.get("KVC_MOONCAKE_TIMING")
METHODS = ("batch_is_exist", "batch_get_into", "batch_get_into_multi_buffers",
           "batch_get_into_multi_buffer_ranges", "batch_get_session_start",
           "batch_get_session_end", "batch_put_from", "batch_put_from_multi_buffers",
           "batch_put_from_multi_buffer_ranges", "batch_put_session_start",
           "batch_put_session_end", "batch_remove", "register_buffer")


def _install(out_dir: str) -> None:
    try:
        from mooncake.store import MooncakeDistributedStore as Store
    except ImportError:
        return
    totals: dict[str, list[float]] = {}
    lock = threading.Lock()

    def wrap(name: str) -> None:
        orig = getattr(Store, name, None)
        if orig is None:
            return

        def timed(self: object, *args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return orig(self, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with lock:
                    slot = totals.setdefault(name, [0, 0.0])
                    slot[0] += 1
                    slot[1] += dt

        setattr(Store, name, timed)

    for name in METHODS:
        wrap(name)
    path = os.path.join(out_dir, f"{os.getpid()}.json")

    def flush() -> None:
        with lock:
            if not totals:
                return
            doc = json.dumps(totals)
        with open(path + ".tmp", "w") as fh:
            fh.write(doc)
        os.replace(path + ".tmp", path)

    def loop() -> None:
        while True:
            time.sleep(1.0)
            flush()

    threading.Thread(target=loop, daemon=True, name="kvc-mc-timing").start()
    atexit.register(flush)


if _DIR:
    _install(_DIR)
