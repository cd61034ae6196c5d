"""The suite's own hygiene (issue 44): no ``time.sleep`` used as synchronisation in tests,
and the session's environment (no usage statistics, caches of its own) reaches the
engines it starts.

**The sleep rule.** Every call of ``time.sleep`` (or of ``sleep`` imported from ``time``)
in ``tests/**/*.py`` must be one of:

1. *a poll step*: the call sits in a ``while`` loop of the same function, and that loop
   has a deadline, i.e. its condition reads a clock (``time.monotonic()``,
   ``time.time()``, ``time.perf_counter()``) or a name containing ``deadline``, or one
   of the statements directly in its body is an ``if`` whose test does so and whose body
   leaves the loop (``break``, ``return``, ``raise``), or an ``assert`` whose test does
   so. The loop's exit is the event, the
   sleep only its polling interval (tests/helpers/waiting.py is the shared one);
2. *not synchronisation at all*: a process that models work or idleness (a hung client
   that sleeps for ever, a fake engine's step), marked on its line with
   ``# not-sync: <why>`` (the reason must be given).

A sleep followed by an assertion ("by now it must have happened") is neither, and fails
this test: wait for the event itself, or for positive evidence that it would have
happened, with a deadline.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns"}
MARK = "# not-sync:"


def _reads_a_deadline(expr: ast.AST) -> bool:
    for n in ast.walk(expr):
        if isinstance(n, ast.Name) and "deadline" in n.id.lower():
            return True
        if isinstance(n, ast.Attribute) and "deadline" in n.attr.lower():
            return True
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in CLOCKS and isinstance(n.func.value, ast.Name)
                and n.func.value.id == "time"):
            return True
    return False


def _leaves(body: list[ast.stmt]) -> bool:
    return any(isinstance(n, (ast.Break, ast.Return, ast.Raise))
               for s in body for n in ast.walk(s))


def _is_deadline_loop(loop: ast.While) -> bool:
    if _reads_a_deadline(loop.test):
        return True
    return any((isinstance(s, ast.If) and _reads_a_deadline(s.test) and _leaves(s.body))
               or (isinstance(s, ast.Assert) and _reads_a_deadline(s.test))
               for s in loop.body)


def _sleep_names(tree: ast.Module) -> set[str]:
    """Names bound to ``time.sleep`` by ``from time import sleep [as x]``."""
    return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and n.module == "time" for a in n.names if a.name == "sleep"}


def _is_sleep(call: ast.Call, names: set[str]) -> bool:
    f = call.func
    return ((isinstance(f, ast.Attribute) and f.attr == "sleep"
             and isinstance(f.value, ast.Name) and f.value.id == "time")
            or (isinstance(f, ast.Name) and f.id in names))


def violations(source: str, filename: str = "<test>") -> list[str]:
    """``file:line`` of every ``time.sleep`` in ``source`` that breaks the rule above."""
    tree = ast.parse(source, filename)
    lines = source.splitlines()
    names = _sleep_names(tree)
    parents: dict[ast.AST, ast.AST] = {}
    for p in ast.walk(tree):
        for c in ast.iter_child_nodes(p):
            parents[c] = p
    out: list[tuple[int, str]] = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and _is_sleep(n, names)):
            continue
        line = lines[n.lineno - 1]
        if MARK in line and line.split(MARK, 1)[1].strip():
            continue
        p = parents.get(n)
        ok = False
        while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda, ast.Module)):
            if isinstance(p, ast.While) and _is_deadline_loop(p):
                ok = True
                break
            p = parents.get(p)
        if not ok:
            out.append((n.lineno, f"{filename}:{n.lineno}: {line.strip()}"))
    return [v for _, v in sorted(out)]


def test_the_rule_itself() -> None:
    good = '''
import time
from time import sleep as nap

def poll(deadline):
    while time.monotonic() < deadline:
        time.sleep(0.01)

def poll2(t):
    while True:
        if time.monotonic() > t:
            raise TimeoutError
        nap(0.01)

def poll3(q, deadline):
    while not q:
        assert time.monotonic() < deadline, "late"
        time.sleep(0.01)

def worker():
    time.sleep(3600)  # not-sync: a hung client, killed by the test
'''
    assert violations(good) == []
    bad = '''
import time
from time import sleep

def settle():
    time.sleep(0.2)
    assert True

def counted():
    for _ in range(10):
        time.sleep(0.1)

def unbounded(q):
    while not q:
        sleep(0.1)

def no_reason():
    time.sleep(1)  # not-sync:

def exit_without_leaving(deadline):
    while True:
        if time.monotonic() > deadline:
            print("late")
        time.sleep(0.1)
'''
    assert [v.split(":")[1] for v in violations(bad)] == ["6", "11", "15", "18", "24"]


def test_no_sleep_is_used_as_synchronisation() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += violations(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, ("time.sleep used as synchronisation (wait for the event with a "
                       "deadline, tests/helpers/waiting.py):\n" + "\n".join(found))


def test_engines_inherit_no_telemetry_and_caches_of_their_own() -> None:
    """tests/conftest.py set the session's environment before any engine starts; a
    process started the way tests start engines and stores (this environment, inherited)
    has vLLM's usage statistics off and its caches outside ``$HOME``."""
    from tests.helpers.hermetic import NO_TELEMETRY, cache_dirs

    for k, v in NO_TELEMETRY.items():
        assert os.environ.get(k) == v, k
    home = Path("~").expanduser().resolve()
    for k in cache_dirs(Path("/x")):
        d = Path(os.environ[k]).resolve()
        assert d.is_dir() and home not in (d, *d.parents), (k, d)
    probe = ("from vllm.usage.usage_lib import is_usage_stats_enabled\n"
             "import vllm.envs as e\n"
             "print(is_usage_stats_enabled(), e.VLLM_CACHE_ROOT, e.VLLM_CONFIG_ROOT)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    enabled, cache, config = r.stdout.split()[-3:]
    assert enabled == "False"
    assert cache == os.environ["VLLM_CACHE_ROOT"] and config == os.environ["VLLM_CONFIG_ROOT"]


def test_engines_start_with_the_sessions_kv_cache_and_executor(tmp_path: Path) -> None:
    """An engine a test starts runs without torch.compile and gets the session's KV size
    as vLLM's flag, with the legacy variable (which vLLM's CPU platform lets override the
    flag) removed; one that sets VLLM_CPU_KVCACHE_SPACE itself keeps it. Shown with a
    stand-in interpreter that records the command and environment it was started with."""
    import json

    from kvcentric.testing.servers import EXECUTOR_ENV, KV_BYTES_ENV, VllmServer
    from tests.helpers.hermetic import ENGINE_EXECUTOR, ENGINE_KV_BYTES, NO_COMPILE
    from tests.helpers.waiting import wait_until

    assert os.environ[KV_BYTES_ENV] == ENGINE_KV_BYTES[KV_BYTES_ENV]
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['OUT'] + '.tmp', 'w').write(json.dumps("
                    "[sys.argv, dict(os.environ)]))\n"
                    "os.rename(os.environ['OUT'] + '.tmp', os.environ['OUT'])\n")
    fake.chmod(0o755)

    def started(env: dict[str, str], args: tuple[str, ...] = ()
                ) -> tuple[list[str], dict[str, str]]:
        out = tmp_path / f"seen-{len(list(tmp_path.glob('seen-*')))}"
        srv = VllmServer("m", python=str(fake), env={"OUT": str(out), **env},
                         args=args).start()
        assert wait_until(out.exists, 60), "the stand-in never ran"
        srv.stop()
        argv, seen = json.loads(out.read_text())
        return argv, seen

    argv, seen = started({})
    assert seen["TORCHDYNAMO_DISABLE"] == NO_COMPILE["TORCHDYNAMO_DISABLE"] == "1"
    i = argv.index("--kv-cache-memory-bytes")
    assert argv[i + 1] == ENGINE_KV_BYTES[KV_BYTES_ENV]
    assert "VLLM_CPU_KVCACHE_SPACE" not in seen
    # one rank: its worker in the EngineCore process; two ranks keep vLLM's worker processes
    assert os.environ[EXECUTOR_ENV] == ENGINE_EXECUTOR[EXECUTOR_ENV] == "uni"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert seen["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    argv, seen = started({"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert "--kv-cache-memory-bytes" not in argv and seen["VLLM_CPU_KVCACHE_SPACE"] == "2"
    argv, seen = started({}, ("--tensor-parallel-size", "2"))
    assert "--distributed-executor-backend" not in argv
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in seen
