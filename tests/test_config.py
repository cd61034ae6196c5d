from pathlib import Path

import pytest

from kvcentric.config import StoreConfig, parse_size


@pytest.mark.parametrize("raw,want", [(4096, 4096), ("4096", 4096), ("512mb", 512 << 20),
                                      ("16gb", 16 << 30), ("1.5GiB", 3 << 29), ("2k", 2048),
                                      ("0", 0)])
def test_parse_size(raw: object, want: int) -> None:
    assert parse_size(raw) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["", "12xb", "-1", -5, True, "1.2.3gb"])
def test_parse_size_rejects(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_size(raw)  # type: ignore[arg-type]


def test_store_config_from_dict() -> None:
    cfg = StoreConfig.from_dict({"name": "a", "capacity": "1gb", "runtime_dir": "/tmp/x",
                                 "op_timeout_s": "2"})
    assert cfg.capacity_bytes == 1 << 30 and cfg.runtime_dir == Path("/tmp/x")
    assert cfg.op_timeout_s == 2.0 and cfg.socket_path == Path("/tmp/x/a.sock")
    with pytest.raises(ValueError, match="unknown store config keys"):
        StoreConfig.from_dict({"capcity": 1})
    with pytest.raises(ValueError, match="backend"):
        StoreConfig.from_dict({"backend": "redis"})
    with pytest.raises(ValueError, match="name"):
        StoreConfig.from_dict({"name": "a/b"})
    with pytest.raises(ValueError):
        StoreConfig.from_dict({"capacity": 0})
    with pytest.raises(ValueError):
        StoreConfig.from_dict({"op_timeout_s": 0})
    with pytest.raises(AttributeError):
        cfg.name = "b"  # type: ignore[misc]


def test_runtime_dir_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCENTRIC_RUNTIME_DIR", "/tmp/kvc-env")
    assert StoreConfig().runtime_dir == Path("/tmp/kvc-env")


def test_connector_settings() -> None:
    from kvcentric.connector.vllm.settings import ConnectorSettings

    s = ConnectorSettings.from_extra_config({"store": {"name": "x", "capacity": "1gb"}})
    assert s.store.name == "x" and s.load_failure_policy == "recompute"
    assert s.stored_block_size(128) == 128  # vLLM CPU pages
    assert s.stored_block_size(16) == 256 and s.stored_block_size(48) == 288
    assert ConnectorSettings(block_size=512).stored_block_size(128) == 512
    with pytest.raises(ValueError, match="multiple"):
        ConnectorSettings(block_size=200).stored_block_size(128)
    with pytest.raises(ValueError, match="unknown kvcentric connector options"):
        ConnectorSettings.from_extra_config({"blocksize": 1})
    with pytest.raises(ValueError):
        ConnectorSettings(load_failure_policy="ignore")
