"""``kvcentric doctor`` against a real vLLM engine: a store holding another layout's keys,
an engine writing to another store, router configs naming the wrong model or block size,
with the healthy case next to each. (tests/test_doctor.py holds the diagnoses that need no
engine: a module of its own so that they run beside the engine tests, not behind them.)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from kvcentric import doctor
from kvcentric.config import StoreConfig
from kvcentric.doctor import layout, router_checks
from kvcentric.hashing import KEY_PREFIX
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer, connector_config
from tests.test_doctor import ROOT, cli


# ---- a real engine: layouts and the router config ----
class Engine:
    def __init__(self, server: VllmServer, store: StoreConfig, model: str) -> None:
        self.server, self.store, self.model = server, store, model

    def reset(self) -> None:
        """An empty store that holds one real request's blocks."""
        with open_store(self.store) as s:
            s.clear()
        self.server.complete([7 + i % 500 for i in range(300)], max_tokens=2)


@pytest.fixture(scope="module")
def engine(runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = str(build_model("tiny", ROOT / ".models" / "tiny"))
    store = {"name": f"doc-{uuid.uuid4().hex[:8]}", "capacity": "256mb",
             "runtime_dir": str(runtime_dir)}
    log = tmp_path_factory.mktemp("doctor") / "vllm.log"
    server = VllmServer(model, kv_transfer=connector_config(store), log_path=log)
    try:
        yield Engine(server.start().wait_ready(), StoreConfig.from_dict(store), model)
    finally:
        server.stop()
        launcher.stop(StoreConfig.from_dict(store))


def _foreign_keys(store: StoreConfig, sig: str, n: int = 3) -> None:
    data = np.zeros(4096, dtype=np.uint8)
    keys = [f"{KEY_PREFIX}/tiny/{sig}/0of1/{i:032x}" for i in range(n)]
    with open_store(store) as s:
        assert s.batch_put_from(keys, [data.ctypes.data] * n, [data.nbytes] * n) == [0] * n


@pytest.mark.vllm
def test_layout_matches(engine: Engine) -> None:
    engine.reset()
    with open_store(engine.store) as s:
        before = set(s.list_keys(KEY_PREFIX, 10000))
    f, probe = layout.check_layout(engine.store, engine.server.url)
    assert f.status == "ok", f
    assert probe is not None and probe.model_id == "tiny" and probe.block_size == 128
    assert f.details["store_layouts"] == {f"{probe.layout_sig}/0of1": len(before)}
    with open_store(engine.store) as s:  # the probe removed its own objects
        assert set(s.list_keys(KEY_PREFIX, 10000)) == before


@pytest.mark.vllm
def test_store_holding_another_layout(engine: Engine) -> None:
    """The zero-hit trap: the store is full of blocks an engine of another layout (dtype,
    block size, ISA, ...) wrote; this engine can never load one. Through the CLI."""
    with open_store(engine.store) as s:
        s.clear()
    _foreign_keys(engine.store, "0123456789abcdef")
    store = json.dumps({"name": engine.store.name,
                        "runtime_dir": str(engine.store.local.runtime_dir)})
    rc, found = cli("--store", store, "--url", engine.server.url, "--skip-engines")
    assert rc == 1
    f = found["layout-signature"]
    assert f["status"] == "fail" and "zero-hit trap" in f["message"]
    assert "0123456789abcdef/0of1" in f["message"]
    assert found["engine-url-version"]["status"] == "ok"


@pytest.mark.vllm
def test_engine_writing_to_another_store(engine: Engine, store_cfg: StoreConfig) -> None:
    """The doctor (like a router) is given a store the engine does not write to."""
    open_store(store_cfg).close()
    f, probe = layout.check_layout(store_cfg, engine.server.url)
    assert probe is None and f.status == "fail" and "wrote no block" in f.message


def _router(tmp: Path, engine: Engine, **over: Any) -> str:
    cfg = {"model": "tiny", "tokenizer": engine.model, "store": {
        "name": engine.store.name, "runtime_dir": str(engine.store.local.runtime_dir)},
        "instances": [{"url": engine.server.url, "role": "both", "name": "e0"}], **over}
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.vllm
def test_router_config_matches(engine: Engine, tmp_path: Path) -> None:
    engine.reset()
    findings = doctor.run(doctor.DoctorInputs(None, _router(tmp_path, engine),
                                              engine.server.url))
    bad = [f for f in findings if f.status == "fail"]
    assert not bad, bad
    assert [f.status for f in findings if f.check == "router-instance"] == ["ok"]


@pytest.mark.vllm
def test_router_config_naming_the_wrong_model(engine: Engine, tmp_path: Path) -> None:
    cfg = router_checks.load_router(_router(tmp_path, engine, model="llama-3-8b"))[0]
    (f,) = router_checks.check_router(cfg, None)
    assert f.status == "fail" and "llama-3-8b" in f.message and "tiny" in f.message


@pytest.mark.vllm
def test_router_config_with_another_block_size(engine: Engine, tmp_path: Path) -> None:
    """keys.block_size 256 while the connector stores the engine's 128-token pages: the
    router would look up keys no engine writes."""
    engine.reset()
    path = _router(tmp_path, engine, keys={"block_size": 256})
    cfg = router_checks.load_router(path)[0]
    _, probe = layout.check_layout(engine.store, engine.server.url)
    (f,) = router_checks.check_router(cfg, probe)
    assert f.status == "fail" and "128-token blocks" in f.message
    assert "keys.block_size: 128" in f.message
