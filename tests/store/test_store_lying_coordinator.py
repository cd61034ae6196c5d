"""A coordinator that lies: a fake process speaking the protocol (tests/helpers/
fake_coordinator.py) sends paths and offsets outside the store's files (issue 32).

The bar: the client refuses (``StoreUnavailable``; an engine's calls miss or return
``ERR_UNAVAILABLE``, so it recomputes), maps no file but its store's own arena, never
copies outside that arena, and never opens a file outside the disk tier; the truthful
fake works, so each refusal is the lie's.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_UNAVAILABLE, OK, StoreUnavailable, open_store
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.disk import DATA_OFFSET

SIZE = 4096


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the store, shaped like an object file, with a payload to spot."""
    p = tmp_path / "outside" / "secret.kvc"
    p.parent.mkdir()
    p.write_bytes(bytes(DATA_OFFSET) + b"\x5a" * SIZE + bytes(64 << 20))
    return p


def fake(tmp_path: Path, lie: str, outside: Path, tier: bool = False
         ) -> Iterator[tuple[StoreConfig, Path]]:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    cfg = StoreConfig.from_dict({"name": f"f{uuid.uuid4().hex[:8]}", "runtime_dir": rt,
                                 "capacity_bytes": 8 << 20, "autostart": False,
                                 "hot_timeout_s": 2.0, "op_timeout_s": 5.0})
    argv = [sys.executable, "-m", "tests.helpers.fake_coordinator", "--runtime-dir", str(rt),
            "--name", cfg.name, "--lie", lie, "--outside", str(outside),
            "--log", str(tmp_path / "fake.log")]
    if tier:
        (tmp_path / "tier").mkdir(mode=0o700)
        argv += ["--tier", str(tmp_path / "tier")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield cfg, tmp_path / "fake.log"
    finally:
        proc.kill()
        proc.wait()


def mapped(path: Path | str) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def put_one(store: LocalStore, key: str) -> list[int]:
    src = np.full(SIZE, 7, np.uint8)
    return store.batch_put_from([key], [src.ctypes.data], [SIZE])


def get_one(store: LocalStore, key: str) -> tuple[list[int], np.ndarray]:
    dst = np.zeros(SIZE, np.uint8)
    return store.batch_get_into([key], [dst.ctypes.data], [SIZE]), dst


def test_the_truthful_fake_is_served(tmp_path: Path, outside: Path) -> None:
    for cfg, _ in fake(tmp_path, "truthful", outside):
        with LocalStore(cfg) as s:
            assert put_one(s, "k") == [OK]
            got, dst = get_one(s, "k")
            assert got == [SIZE] and (dst == 7).all()


@pytest.mark.parametrize("lie", ["arena-outside", "arena-symlink", "arena-small",
                                 "index-outside", "generation-traversal"])
def test_a_hello_naming_other_files_is_refused_and_nothing_is_mapped(
        tmp_path: Path, outside: Path, lie: str) -> None:
    for cfg, _ in fake(tmp_path, lie, outside):
        with pytest.raises(StoreUnavailable) as err:
            LocalStore(cfg)
        assert "refusing" in str(err.value) or "not this store" in str(err.value) \
            or "generation" in str(err.value) or "less than" in str(err.value), err.value
        engine = open_store(cfg, required=False)
        assert put_one(engine, "k") == [ERR_UNAVAILABLE]  # the engine recomputes
        engine.close()
        assert not mapped(outside) and not mapped(cfg.local.runtime_dir)


@pytest.mark.parametrize("lie", ["reserve-offset", "acquire-offset"])
def test_offsets_outside_the_arena_are_refused(tmp_path: Path, outside: Path,
                                               lie: str) -> None:
    """A slot or lease past the arena's end: nothing is copied (a copy there would write
    or read past the mapping), the session is closed, the engine gets ERR_UNAVAILABLE."""
    for cfg, log in fake(tmp_path, lie, outside):
        with LocalStore(cfg) as s:
            codes = put_one(s, "k")
            if lie == "reserve-offset":
                assert codes == [ERR_UNAVAILABLE]
                assert "commit" not in log.read_text().split()  # refused before writing
            else:
                assert codes == [OK]
                got, dst = get_one(s, "k")
                assert got == [ERR_UNAVAILABLE] and not dst.any()


@pytest.mark.parametrize("lie", ["promo-offset", "disk-outside", "disk-traversal",
                                 "disk-wrong-key", "disk-symlink"])
def test_disk_tier_files_outside_the_tier_are_never_read(tmp_path: Path, outside: Path,
                                                         lie: str) -> None:
    """Disk-tier entries naming a file outside the tier, one of another key, or a symlink
    in the tier to a file outside: the client refuses the lease (or, for the symlink,
    cannot open it: the object reads as missing); no byte of the outside file arrives."""
    for cfg, _ in fake(tmp_path, lie, outside, tier=True):
        with LocalStore(cfg) as s:
            assert put_one(s, "k") == [OK]
            got, dst = get_one(s, "k")
            assert got[0] != SIZE and not (dst == 0x5A).any(), got
            assert not mapped(outside)
