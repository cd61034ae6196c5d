"""The store backend registry (kvcentric.store.backends): a backend defined here, in new
code only, joins with one registration line and passes the shared store contract; the
built-in backends' configs round-trip through their own dataclasses."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvcentric.config import StoreConfig, parse_fields
from kvcentric.store import ERR_INVALID, ERR_NO_SPACE, ERR_NOT_FOUND, OK, KVStore, open_store
from kvcentric.store.backends import BACKENDS, StoreBackend, get_backend, register_backend
from kvcentric.store.mooncake.config import MooncakeSettings
from tests.store.store_contract import StoreContract, put

# ---- a whole backend, as a new package would hold it ----


@dataclass(frozen=True)
class ToySettings:
    """The toy backend's ``store.toy`` section (its keys may also be given at the top level of
    a store mapping that selects it, under these names or the ``ALIASES``)."""

    ALIASES: ClassVar[Mapping[str, str]] = {"capacity": "capacity_bytes"}

    capacity_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("store.toy.capacity must be positive")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None,
                     env: Mapping[str, str] | None = None) -> ToySettings:
        return cls(**parse_fields(cls, raw, "store.toy", aliases=cls.ALIASES,
                                  sizes={"capacity_bytes"}))

    def to_mapping(self) -> dict[str, Any]:
        return asdict(self)


class ToyStore(KVStore):
    """A process-local LRU dict of byte strings, bounded by its capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.objs: OrderedDict[str, bytes] = OrderedDict()
        self.counts = dict.fromkeys(("hits", "misses", "puts", "gets", "evictions"), 0)

    @classmethod
    def open(cls, cfg: StoreConfig, required: bool) -> ToyStore:
        return cls(cfg.settings.capacity_bytes)

    def batch_exists(self, keys: Sequence[str]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.objs), len(keys))

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                       parents: Sequence[str | None] | None = None) -> list[int]:
        out = []
        for k, p, s in zip(keys, ptrs, sizes):
            if k in self.objs or s > self.capacity:
                out.append(OK if k in self.objs else ERR_NO_SPACE)
                continue
            while self.used + s > self.capacity:
                self.used -= len(self.objs.popitem(last=False)[1])
                self.counts["evictions"] += 1
            self.objs[k] = ctypes.string_at(p, s)
            self.used += s
            self.counts["puts"] += 1
            out.append(OK)
        return out

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        out = []
        for k, p, s in zip(keys, ptrs, sizes):
            self.counts["gets"] += 1
            v = self.objs.get(k)
            self.counts["hits" if v is not None else "misses"] += 1
            if v is None or len(v) > s:
                out.append(ERR_NOT_FOUND if v is None else ERR_INVALID)
                continue
            self.objs.move_to_end(k)
            ctypes.memmove(p, v, len(v))
            out.append(len(v))
        return out

    def remove(self, key: str, force: bool = False) -> int:
        v = self.objs.pop(key, None)
        self.used -= len(v or b"")
        return ERR_NOT_FOUND if v is None else OK

    def stats(self) -> dict[str, Any]:
        return {"used_bytes": self.used, "capacity_bytes": self.capacity,
                "keys": len(self.objs), **self.counts}

    def close(self) -> None:
        self.objs.clear()

    def list_keys(self, prefix: str = "", limit: int = 1000) -> list[str]:
        return [k for k in self.objs if k.startswith(prefix)][:limit]


# ---- the one registration line (undone after each test) ----

@pytest.fixture(autouse=True)
def toy_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BACKENDS, "toy", StoreBackend("toy", ToyStore.open, settings=ToySettings))


TOY = {"backend": "toy", "toy": {"capacity": "16mb"}}


@pytest.fixture
def store() -> Iterator[KVStore]:
    s = open_store(TOY)
    assert isinstance(s, ToyStore)
    yield s
    s.close()


class TestToyContract(StoreContract):
    # the contract's cross-process test does not apply: the toy backend is registered in
    # this process only, so another process could not name it (not collected: None)
    test_another_process_reads_and_writes = None  # type: ignore[assignment]


def test_toy_section_is_parsed_by_its_own_dataclass() -> None:
    cfg = StoreConfig.from_dict(TOY)
    assert cfg.sections == {"toy": ToySettings(16 << 20)} and not cfg.verify_checksums
    assert cfg.settings == ToySettings(16 << 20)
    assert StoreConfig.from_dict({"backend": "toy", "capacity": "8mb"}).settings == ToySettings(
        8 << 20)  # its own keys at the top level, as a local store's are given
    assert StoreConfig.from_dict({"backend": "toy"}).settings == ToySettings()
    with pytest.raises(ValueError, match="at the top level or in store.toy, not both"):
        StoreConfig.from_dict({"backend": "toy", "capacity": "8mb", "toy": {}})
    with pytest.raises(ValueError, match=r"unknown keys in store\.toy: \['size'\]"):
        open_store({"backend": "toy", "toy": {"size": 1}})
    with pytest.raises(ValueError, match="store.toy.capacity must be positive"):
        open_store({"backend": "toy", "toy": {"capacity": 0}})


def test_unknown_backends_and_sections_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown store backend 'nope'; use 'local', "
                                         r"'mooncake' or 'toy'"):
        StoreConfig.from_dict({"backend": "nope"})
    monkeypatch.delitem(BACKENDS, "toy")
    with pytest.raises(ValueError, match=r"unknown store backend 'toy'"):
        StoreConfig.from_dict(TOY)
    with pytest.raises(ValueError, match=r"unknown keys in store: \['toy'\]"):
        StoreConfig.from_dict({"toy": TOY["toy"]})
    with pytest.raises(ValueError, match=r"unknown keys in store: \['runtime_dir'\]"):
        StoreConfig.from_dict({"backend": "mooncake", "runtime_dir": "/tmp"})  # a local key
    with pytest.raises(ValueError, match="unknown store backend 'nope'; use 'local' or "
                                         "'mooncake'"):
        get_backend("nope")


def test_register_backend_refuses_a_taken_or_bad_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_backend(StoreBackend("toy", ToyStore.open))
    with pytest.raises(ValueError, match="would shadow the store key"):
        register_backend(StoreBackend("name", ToyStore.open))
    with pytest.raises(ValueError, match="must be 1 to 32 lower-case"):
        StoreBackend("Toy-2", ToyStore.open)


def test_the_registry_imports_no_backend() -> None:
    """Naming backends costs nothing: no wheel, no torch, no local client until opened."""
    code = ("import sys, kvcentric.store.backends as b; from kvcentric.config import "
            "StoreConfig; StoreConfig.from_dict({'backend': 'mooncake'}); "
            "print(sorted(m for m in ('torch', 'mooncake', 'kvcentric.store.local.client', "
            "'kvcentric.store.mooncake.store', 'kvcentric.doctor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_doctor_reaches_a_new_backend_through_its_defaults() -> None:
    from kvcentric.doctor.layout import list_keys
    from kvcentric.doctor.stores import store_findings

    cfg = StoreConfig.from_dict(TOY)
    (finding,) = store_findings(cfg)
    assert finding.check == "store-reachable" and finding.status == "ok", finding
    assert list_keys(cfg) == []  # a fresh toy store per open: nothing under the prefix


def test_toy_store_holds_what_it_was_given() -> None:
    with open_store(TOY) as s:
        assert put(s, ["a", "b"]) == [OK, OK] and s.list_keys() == ["a", "b"]


# ---- the built-in backends' configs, written out and read back by their own functions ----

def test_local_config_round_trips_through_the_launcher(tmp_path: Path) -> None:
    from kvcentric.store.local.launcher import config_json

    cfg = StoreConfig.from_dict({
        "name": "rt", "capacity": "64mb", "runtime_dir": str(tmp_path), "idle_timeout_s": 3,
        "lease_ttl_s": 9, "max_pin_s": 5, "max_pinned_bytes": "8mb", "peer_group": "0",
        "hot_timeout_s": 0.5, "shared_index": False,
        "disk": {"path": str(tmp_path / "d"), "capacity": "1mb", "writers": 2,
                 "high_watermark": 0.25, "dirty_limit": 0.75, "put_wait_s": 0.01,
                 "seal_key": "k" * 16}})
    raw = json.loads(config_json(cfg))
    assert StoreConfig.from_dict(raw) == cfg
    assert StoreConfig.from_dict(json.loads(config_json(StoreConfig()))) == StoreConfig()
    assert raw["local"]["disk"]["seal_key"] == "k" * 16  # the launcher sends it on a pipe
    assert set(raw) == {"backend", "name", "verify_checksums", "op_timeout_s", "hot_timeout_s",
                        "min_transfer_rate", "reconnect_interval_s", "local"}
    # the same keys in the local store's own section, and changed through with_
    assert StoreConfig.from_dict({"name": "rt", "hot_timeout_s": 0.5,
                                  "local": raw["local"]}) == cfg
    moved = cfg.with_(runtime_dir=tmp_path / "x", hot_timeout_s=0.25)
    assert moved.local.runtime_dir == tmp_path / "x" and moved.hot_timeout_s == 0.25
    assert moved.local.disk == cfg.local.disk and cfg.local.runtime_dir == tmp_path
    with pytest.raises(ValueError, match=r"\['master_server_address'\] are not all keys of a "
                                         "local store"):
        cfg.with_(master_server_address="10.0.0.1:5000")


def test_mooncake_config_round_trips_through_its_dataclass() -> None:
    cfg = StoreConfig.from_dict({"backend": "mooncake", "mooncake": {
        "use_env": False, "master_server_address": "10.0.0.1:5000", "protocol": "RDMA",
        "global_segment_size": "32mb", "preferred_segment": "local"}})
    assert cfg.verify_checksums and cfg.mooncake.protocol == "rdma"
    assert cfg.settings is cfg.mooncake and cfg.mooncake.global_segment_size == 32 << 20
    again = StoreConfig.from_dict(cfg.to_mapping())
    assert again == cfg and again.mooncake == cfg.mooncake
    settings = MooncakeSettings.from_mapping({"use_env": False}, env={"MOONCAKE_REPLICA_NUM": "3"})
    assert settings.replica_num == 1  # use_env: false
    with pytest.raises(ValueError, match="a mooncake store: it has no local settings"):
        cfg.local  # noqa: B018
    with pytest.raises(ValueError, match="store.disk is not a setting of a mooncake store: "
                                         "for Mooncake's own SSD offload set mooncake.ssd_"):
        StoreConfig.from_dict({"backend": "mooncake", "disk": {"path": "/tmp", "capacity": 1}})
    assert type(settings).from_mapping(settings.to_mapping(), env={}) == settings
