"""The router gives the heap it freed back to the system (router/ops/memory.py): glibc keeps
pages freed below a live block resident, ``malloc_trim`` returns them, the router's
lifespan runs it every ``memory.trim_interval_s`` and counts what came back."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from kvcentric.router.api.app import build_app
from kvcentric.router.config import MemoryConfig, RouterConfig
from kvcentric.router.ops.memory import HeapTrimmer, glibc_malloc
from kvcentric.router.tokenize import PromptTokenizer
from tests.router.test_router_app import PROFILE, TWO, Upstreams, make_cfg

MiB = 2**20


def fragment_heap(mib: int = 48) -> list[bytes]:
    """Allocate ``mib`` MiB in 2 KiB blocks (glibc's, not pymalloc's), free all but every
    64th: the freed pages sit below live blocks, where glibc never trims on its own."""
    blocks = [bytes(2048) for _ in range(mib * MiB // 2048)]
    return blocks[::64]


def test_freed_heap_stays_resident_until_trimmed() -> None:
    """In a fresh process: the fragmented heap's freed pages stay in RSS, one trim gives
    back most of them (without the trim this is what the soak's RSS curve showed)."""
    code = textwrap.dedent("""
        from kvcentric.router.ops.memory import HeapTrimmer, rss_bytes
        from tests.router.test_router_memory import fragment_heap
        base = rss_bytes()
        keep = fragment_heap(48)
        held = rss_bytes() - base
        released = HeapTrimmer(60.0).trim()
        print(held, released, rss_bytes() - base, len(keep))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60,
                         cwd=Path(__file__).parents[2]).stdout.split()
    held, released, after = (int(x) / MiB for x in out[:3])
    assert held > 40, f"freed blocks below live ones should stay resident, held {held:.1f} MiB"
    assert released > 30 and after < held - 30, (held, released, after)


ARENAS = textwrap.dedent("""
    import ctypes, re, sys, threading
    from kvcentric.router.ops.memory import limit_arenas
    if sys.argv[1] != "0":
        assert limit_arenas(int(sys.argv[1]))
    held, go = [], threading.Barrier(6)
    def work():
        go.wait()  # all allocating at once: glibc gives a contended thread a new arena
        held.append([bytes(1024) for _ in range(4000)])
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p),
                                    ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(len(re.findall(rb'<heap nr="', buf.value)))
""")


def arenas_used(limit: int) -> int:
    out = subprocess.run([sys.executable, "-c", ARENAS, str(limit)], capture_output=True,
                         text=True, check=True, timeout=60, cwd=Path(__file__).parents[2])
    return int(out.stdout)


def test_the_arena_cap_holds_while_threads_allocate_at_once() -> None:
    """glibc's default gives threads that allocate at once arenas of their own (each a heap
    that stays mapped); with the router's cap they share at most that many."""
    assert arenas_used(0) > 2
    assert arenas_used(2) <= 2


def test_glibc_is_what_runs_here() -> None:
    """The CI machine's Python is on glibc: the trimmer must not silently be a no-op."""
    assert HeapTrimmer(1.0).available
    assert set(glibc_malloc()) == {"glibc_heap_mib", "glibc_in_use_mib", "glibc_free_mib",
                                   "glibc_mmapped_mib"}


def test_the_trimmer_runs_every_interval_until_cancelled() -> None:
    released: list[int] = []

    async def go() -> None:
        task = asyncio.get_running_loop().create_task(
            HeapTrimmer(0.01, released.append).run())
        for _ in range(500):
            if len(released) >= 3:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert len(released) >= 3 and all(r >= 0 for r in released)


def released_bytes(metrics: str) -> float:
    line = next(x for x in metrics.splitlines()
                if x.startswith("kvc_router_heap_released_bytes_total "))
    return float(line.split()[1])


def test_the_router_trims_on_its_interval_and_counts_it(tiny_dir: str,
                                                         tokenizer: PromptTokenizer) -> None:
    cfg = make_cfg(tiny_dir, TWO, memory={"trim_interval_s": 0.05})
    app = build_app(cfg, transport=httpx.MockTransport(Upstreams().handler),
                    tokenizer=tokenizer, profile=PROFILE)

    async def go() -> float:
        async with app.router.lifespan_context(app):
            assert not app.state.router.tasks["trim"].done()
            keep = fragment_heap(32)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://router") as client:
                for _ in range(200):
                    got = released_bytes((await client.get("/metrics")).text)
                    if got > 8 * MiB:
                        break
                    await asyncio.sleep(0.02)
            del keep
            return got

    assert asyncio.run(go()) > 8 * MiB


def test_trimming_can_be_turned_off(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    cfg = make_cfg(tiny_dir, TWO, memory={"trim_interval_s": 0})
    app = build_app(cfg, transport=httpx.MockTransport(Upstreams().handler),
                    tokenizer=tokenizer, profile=PROFILE)

    async def go() -> None:
        async with app.router.lifespan_context(app):
            assert "trim" not in app.state.router.tasks

    asyncio.run(go())


@pytest.mark.parametrize("bad", [-1, math.nan, True, "soon"])
def test_bad_memory_settings_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="malloc_arenas"):
        MemoryConfig(malloc_arenas=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="malloc_arenas"):
        MemoryConfig(malloc_arenas=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trim_interval_s"):
        MemoryConfig(trim_interval_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trim_interval_s"):
        RouterConfig.from_dict({"model": "m", "tokenizer": "t",
                                "memory": {"trim_interval_s": bad}})
