"""The disk tier on a shared host (issue 32): its directory, recovery and keyed seals.

- A tier directory another user made (``nobody``, in a world-writable parent), one
  writable by others or a symlink: the coordinator refuses to start (``store serve``
  exits non-zero, clients get ``StoreUnavailable``), naming the path, owner and mode.
- Recovery with planted symlinks (a subdirectory leading elsewhere holding ``*.tmp`` and
  unverifiable files, a ``*.tmp`` symlink to a file elsewhere, an object's name leading to
  a valid object file elsewhere) deletes nothing outside the tier and serves nothing
  reached through a symlink.
- With ``seal_key``, restarts serve only files sealed under the key: a file written
  without it (by someone else) or under another key is dropped, never served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvcentric.config import StoreConfig
from kvcentric.store import OK, StoreUnavailable, open_store
from kvcentric.store.local import disk, launcher, ownership
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.config import DiskConfig, disk_dir
from tests.helpers import other_user
from tests.helpers.payload import payload
from tests.helpers.waiting import wait_until
from tests.store.store_contract import get, put

MB = 1 << 20
KEY = "0123456789abcdef0123"  # a seal key


@pytest.fixture
def disk_cfg(store_cfg: StoreConfig, tmp_path: Path) -> Iterator[StoreConfig]:
    cfg = store_cfg.with_(capacity_bytes=16 * MB, disk=DiskConfig(tmp_path / "disk", 64 * MB))
    yield cfg
    launcher.stop(cfg)


def settled(store: LocalStore) -> bool:
    st = store.stats()
    return st["demoting"] == 0 and st["disk_recovering"] == 0 and st["dirty_bytes"] == 0


def stop(cfg: StoreConfig) -> None:
    """Stop the coordinator and wait until it let go of the store (its lock)."""
    launcher.stop(cfg)
    assert wait_until(lambda: ownership.holder(cfg) is None, 20)


def write_back(cfg: StoreConfig, keys: list[str]) -> None:
    """Put ``keys`` and stop once every one has its disk file."""
    with open_store(cfg) as s:
        assert isinstance(s, LocalStore)
        assert put(s, keys) == [OK] * len(keys)
        assert wait_until(lambda: settled(s), 20)
        assert s.stats()["disk_objects"] == len(keys)
    stop(cfg)


def file_of(cfg: StoreConfig, key: str) -> Path:
    assert disk_dir(cfg) is not None
    h = xxhash.xxh3_128_hexdigest(key.encode())
    (path,) = (disk_dir(cfg) / h[:2]).glob(f"{h}-*.kvc")
    return path


def restarted(cfg: StoreConfig) -> LocalStore:
    s = open_store(cfg)
    assert isinstance(s, LocalStore)
    assert wait_until(lambda: settled(s), 20)
    return s


def serve(cfg: StoreConfig) -> subprocess.CompletedProcess[str]:
    assert cfg.local.disk is not None
    return subprocess.run(
        [sys.executable, "-m", "kvcentric.cli", "store", "serve", "--name", cfg.name,
         "--runtime-dir", str(cfg.local.runtime_dir), "--capacity", "16mb", "--disk-path",
         str(cfg.local.disk.path), "--disk-capacity", "64mb"],
        capture_output=True, text=True, timeout=60)


# ---- the tier's directory ----
@pytest.mark.skipif(other_user.reason() is not None, reason=other_user.reason() or "")
def test_a_tier_directory_another_user_made_is_refused(store_cfg: StoreConfig) -> None:
    parent = Path("/tmp") / f"kvc-tier-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    parent.chmod(0o1777)  # like /tmp: anyone may create a directory in it
    try:
        cfg = store_cfg.with_(disk=DiskConfig(parent, 64 * MB))
        tier = disk_dir(cfg)
        assert tier is not None
        other_user.python(f"import os; os.mkdir({str(tier)!r}, 0o755); "
                          f"open({str(tier / 'planted.tmp')!r}, 'w').write('x')")
        for refusal in (pytest.raises(StoreUnavailable), ):
            with refusal as err:
                LocalStore(cfg)
            for w in ("disk tier directory", str(tier), "nobody (uid 65534)", "mode 0o755"):
                assert w in str(err.value), (w, str(err.value))
        out = serve(cfg)
        assert out.returncode != 0 and "nobody (uid 65534)" in out.stderr, out
        assert (tier / "planted.tmp").exists() and os.listdir(tier) == ["planted.tmp"]
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.parametrize("how", ["writable by others", "a symlink"])
def test_an_untrusted_tier_directory_of_ours_is_refused(disk_cfg: StoreConfig,
                                                        how: str) -> None:
    tier = disk_dir(disk_cfg)
    assert tier is not None
    tier.parent.mkdir()
    if how == "a symlink":
        real = tier.with_name("real")
        real.mkdir(mode=0o700)
        tier.symlink_to(real)
        words = ["it is a symlink"]
    else:
        tier.mkdir(mode=0o700)
        tier.chmod(0o777)
        words = ["writable by group or others", "mode 0o777"]
    with pytest.raises(StoreUnavailable) as err:
        LocalStore(disk_cfg)
    assert str(tier) in str(err.value) and all(w in str(err.value) for w in words)
    out = serve(disk_cfg)
    assert out.returncode != 0 and all(w in out.stderr for w in words), out


# ---- recovery ----
def test_recovery_never_follows_a_symlink(disk_cfg: StoreConfig, tmp_path: Path) -> None:
    keys = [f"rec/{i}" for i in range(6)]
    write_back(disk_cfg, keys)
    tier = disk_dir(disk_cfg)
    assert tier is not None
    outside = tmp_path / "outside"
    outside.mkdir()
    # 1. a subdirectory of the tier's layout that is a symlink to a directory elsewhere,
    #    holding what recovery deletes in its own subdirectories: a *.tmp, an unverifiable
    #    *.kvc, and a whole object file
    elsewhere = outside / "dir"
    elsewhere.mkdir()
    (elsewhere / "precious.tmp").write_text("keep me")
    (elsewhere / "precious.kvc").write_text("not an object, keep me too")
    moved = file_of(disk_cfg, keys[0])
    shutil.copy(moved, elsewhere / moved.name)
    free = next(f"{i:02x}" for i in range(256) if not (tier / f"{i:02x}").exists())
    (tier / free).symlink_to(elsewhere, target_is_directory=True)
    # 2. in a real subdirectory: a *.tmp symlink to a file elsewhere
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    tmp_link = file_of(disk_cfg, keys[1]).with_name("planted.kvc.tmp")
    tmp_link.symlink_to(victim)
    # 3. an object's own name, now a symlink to its (valid) file moved elsewhere
    real = file_of(disk_cfg, keys[2])
    away = outside / real.name
    real.rename(away)
    real.symlink_to(away)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}

    with restarted(disk_cfg) as s:
        st = s.stats()
        assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
        assert tmp_link.is_symlink() and real.is_symlink()  # left alone, not followed
        assert s.batch_exists([keys[2]]) == 0  # served from nowhere but the tier
        assert [s.batch_exists([k]) for k in keys if k != keys[2]] == [1] * 5
        assert st["recovered"] == 5 and st["recovery_dropped"] == 0, st
        for k, b in zip(keys[:2], get(s, keys[:2])):
            assert b is not None and np.array_equal(b, payload(k, b.nbytes))


# ---- keyed seals ----
def test_keyed_seals_reject_files_written_without_the_key(disk_cfg: StoreConfig) -> None:
    assert disk_cfg.local.disk is not None
    sealed = disk_cfg.with_(disk=DiskConfig(disk_cfg.local.disk.path, 64 * MB, seal_key=KEY))
    keys = [f"seal/{i}" for i in range(4)]
    write_back(sealed, keys)
    assert file_of(sealed, keys[0]).read_bytes()[:8] == disk.MAGIC_SEALED
    # someone without the key writes a well-formed, checksummed object file of a new key
    forged = "seal/forged"
    data = payload(forged, 64 << 10).tobytes()
    path = disk.object_path(disk_dir(sealed), forged, "f00d")  # type: ignore[arg-type]
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(disk.encode_header(forged, None, len(data),
                                        xxhash.xxh3_64_intdigest(data)) + data)
    os.chmod(path, 0o600)

    with restarted(sealed) as s:  # the key: its own files are served, the forged one not
        st = s.stats()
        assert st["recovered"] == 4 and st["recovery_dropped"] == 1, st
        assert s.batch_exists(keys) == 4 and s.batch_exists([forged]) == 0
        assert all(b is not None for b in get(s, keys))
    assert not path.exists()
    stop(sealed)

    other = disk_cfg.with_(disk=DiskConfig(disk_cfg.local.disk.path, 64 * MB,
                                           seal_key="another key, 16+ chars"))
    with restarted(other) as s:  # another key: nothing of the first is served
        st = s.stats()
        assert st["recovered"] == 0 and st["recovery_dropped"] == 4, st
        assert s.batch_exists(keys[:1]) == 0


def test_a_seal_key_is_never_on_a_command_line(disk_cfg: StoreConfig) -> None:
    assert disk_cfg.local.disk is not None
    sealed = disk_cfg.with_(disk=DiskConfig(disk_cfg.local.disk.path, 64 * MB, seal_key=KEY))
    with open_store(sealed) as s:
        pid = s.stats()["pid"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline and sealed.name.encode() in cmdline
        assert KEY not in repr(sealed)
    launcher.stop(sealed)


@pytest.mark.skipif(other_user.reason() is not None, reason=other_user.reason() or "")
def test_a_peer_group_member_reads_the_disk_tier(store_cfg: StoreConfig) -> None:
    """With ``peer_group`` the tier's directories are ``0710`` and its files ``0640``, the
    group's: nobody in the group reads disk-only objects (search permission is all its
    client needs: it opens the tier's directories ``O_PATH``)."""
    base = Path("/dev/shm") / f"kvc-gd-{uuid.uuid4().hex[:8]}"
    tier = Path("/tmp") / f"kvc-gdt-{uuid.uuid4().hex[:8]}"
    for d in (base, tier):
        d.mkdir()
        d.chmod(0o711)
    cfg = store_cfg.with_(runtime_dir=base / "rt", peer_group="nogroup", capacity_bytes=16 * MB,
                          disk=DiskConfig(tier, 256 * MB))
    try:
        with open_store(cfg) as s:
            assert isinstance(s, LocalStore)
            keys = [f"g/{i}" for i in range(120)]  # ~2x DRAM: the first ones leave it
            for i in range(0, len(keys), 8):
                assert put(s, keys[i:i + 8], [keys[i - 1] if i else None,
                                              *keys[i:i + 7]]) == [OK] * 8
                assert wait_until(lambda: s.stats()["demoting"] == 0, 20)
            assert wait_until(lambda: settled(s), 20)
            assert s.batch_residency(keys[:3]).disk_only == (0, 1, 2)
            assert oct((tier / cfg.name).stat().st_mode & 0o777) == "0o710"
            raw = {"name": cfg.name, "runtime_dir": str(cfg.local.runtime_dir),
                   "peer_group": "nogroup", "capacity_bytes": 16 * MB, "hot_timeout_s": 2.0}
            out = other_user.python(f"""
import numpy as np
from kvcentric.config import StoreConfig
from kvcentric.store import open_store
from kvcentric.store.local.config import disk_dir
from tests.helpers.payload import payload
from tests.store.store_contract import get
with open_store(StoreConfig.from_dict({raw!r})) as s:
    ks = ["g/0", "g/1", "g/2"]
    print(s.batch_residency(ks).disk_only, [b is not None and bool(np.array_equal(
        b, payload(k, b.nbytes))) for k, b in zip(ks, get(s, ks))])
""")
            assert out.stdout.strip().splitlines()[-1] == "(0, 1, 2) [True, True, True]", out
    finally:
        launcher.stop(cfg)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
