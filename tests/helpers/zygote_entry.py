"""A stand-in for vLLM's API server entry, run by a test zygote (tests/test_zygote.py).

``main`` writes what it was started with (argv, environment, working directory, process,
group and session ids, what its stdin reads, its network namespace, how many objects it
inherited frozen) as JSON to ``argv[1]``, prints a line to its stdout and one to its
stderr, then by ``argv[2]``:
``exit N`` exits with N, ``block`` waits for a signal, ``raise`` raises."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2:]
    seen = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
            "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
            "stdin": sys.stdin.read(), "netns": os.stat("/proc/self/ns/net").st_ino,
            "frozen": gc.get_freeze_count()}
    with open(out + ".tmp", "w") as f:
        json.dump(seen, f)
    os.rename(out + ".tmp", out)
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode[0] == "exit":
        sys.exit(int(mode[1]))
    if mode[0] == "block":
        signal.pause()
    raise RuntimeError("the entry failed")
