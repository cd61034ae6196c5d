"""The connector's threads leave the cores a pinned CPU worker computes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcentric.connector.vllm.affinity import (
    machine_cpus,
    parse_cpu_list,
    spare_thread,
)


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,6\n") == {0, 1, 2, 3, 6}
    assert parse_cpu_list("1") == {1}
    with pytest.raises(ValueError):
        parse_cpu_list("a-b")


PINNED = """
import os, json, threading
from concurrent.futures import ThreadPoolExecutor
from kvcentric.connector.vllm.affinity import machine_cpus, pin_to, spare_cpus, spare_thread
os.sched_setaffinity(0, {0})  # what vLLM's CPU worker does to its process
spare = spare_cpus()
with ThreadPoolExecutor(1, initializer=pin_to, initargs=(spare,)) as pool:
    pooled = pool.submit(os.sched_getaffinity, 0).result()
def child_thread_affinity():
    box = []
    t = threading.Thread(target=lambda: box.append(os.sched_getaffinity(0)))
    t.start(); t.join()
    return box[0]
inherited = spare_thread(child_thread_affinity)  # e.g. a store client's own threads
print(json.dumps({"spare": sorted(spare), "pooled": sorted(pooled),
                  "inherited": sorted(inherited), "main": sorted(os.sched_getaffinity(0)),
                  "machine": sorted(machine_cpus())}))
"""


@pytest.mark.skipif(len(machine_cpus()) < 2 or 0 not in machine_cpus(),
                    reason="this machine lacks CPU 0 or a second CPU")
def test_threads_of_a_pinned_worker_move_to_the_spare_cpus() -> None:
    out = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True,
                         timeout=60, check=True)
    got = json.loads(out.stdout)
    rest = sorted(set(got["machine"]) - {0})
    assert got["spare"] == rest and got["pooled"] == rest
    assert got["inherited"] == rest  # threads started from a spare thread stay spare
    assert got["main"] == [0]  # the compute thread itself is left alone


UNPINNED = """
import os, json
from concurrent.futures import ThreadPoolExecutor
from kvcentric.connector.vllm.affinity import pin_to, spare_cpus, spare_thread
with ThreadPoolExecutor(1, initializer=pin_to, initargs=(None,)) as pool:
    pooled = pool.submit(os.sched_getaffinity, 0).result()
print(json.dumps({"spare": spare_cpus() is None, "main": sorted(os.sched_getaffinity(0)),
                  "thread": sorted(spare_thread(os.sched_getaffinity, 0)),
                  "pooled": sorted(pooled)}))
"""


def test_unpinned_threads_are_left_alone() -> None:
    """In a process on every CPU of the machine (a fresh one: a test worker may have been
    pinned by an earlier test), no thread is moved."""
    every = machine_cpus()
    out = subprocess.run([sys.executable, "-c", UNPINNED], capture_output=True, text=True,
                         timeout=60, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, every))
    got = json.loads(out.stdout)
    assert got == {"spare": True, "main": sorted(every), "thread": sorted(every),
                   "pooled": sorted(every)}


def test_spare_thread_reraises() -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        spare_thread(boom)
