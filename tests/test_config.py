from pathlib import Path

import pytest

from kvcentric.config import StoreConfig, parse_size
from kvcentric.store.local.config import socket_path


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
    assert cfg.local.capacity_bytes == 1 << 30 and cfg.local.runtime_dir == Path("/tmp/x")
    assert cfg.op_timeout_s == 2.0 and socket_path(cfg) == Path("/tmp/x/a.sock")
    with pytest.raises(ValueError,
                       match=r"unknown keys in store: \[.capcity.\]; known: .*capacity_bytes"):
        StoreConfig.from_dict({"capcity": 1})
    with pytest.raises(ValueError, match="backend"):
        StoreConfig.from_dict({"backend": "redis"})
    with pytest.raises(ValueError, match="name"):
        StoreConfig.from_dict({"name": "a/b"})
    with pytest.raises(ValueError):
        StoreConfig.from_dict({"capacity": 0})
    with pytest.raises(ValueError):
        StoreConfig.from_dict({"op_timeout_s": 0})
    for key in ("hot_timeout_s", "disk_read_timeout_s"):
        with pytest.raises(ValueError, match=key):
            StoreConfig.from_dict({key: 0})
    assert StoreConfig.from_dict({"hot_timeout_s": "0.25"}).hot_timeout_s == 0.25
    with pytest.raises(ValueError, match="ssd_offload_path"):  # not silently ignored
        StoreConfig.from_dict({"backend": "mooncake", "disk": {"path": "/tmp/kvc-disk",
                                                               "capacity": "1mb"}})
    with pytest.raises(AttributeError):
        cfg.name = "b"  # type: ignore[misc]


def test_runtime_dir_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCENTRIC_RUNTIME_DIR", "/tmp/kvc-env")
    assert StoreConfig().local.runtime_dir == Path("/tmp/kvc-env")


def test_connector_settings() -> None:
    from kvcentric.connector.vllm.settings import ConnectorSettings

    s = ConnectorSettings.from_extra_config({"store": {"name": "x", "capacity": "1gb"}})
    assert s.store.name == "x" and s.load_failure_policy == "recompute"
    assert s.stored_block_size(128) == 128  # vLLM CPU pages
    assert s.stored_block_size(16) == 256 and s.stored_block_size(48) == 288
    assert ConnectorSettings(block_size=512).stored_block_size(128) == 512
    with pytest.raises(ValueError, match="multiple"):
        ConnectorSettings(block_size=200).stored_block_size(128)
    with pytest.raises(ValueError, match=r"unknown keys in kvcentric connector options: "
                                         r"\[.blocksize.\]; known: .*block_size"):
        ConnectorSettings.from_extra_config({"blocksize": 1})
    with pytest.raises(ValueError):
        ConnectorSettings(load_failure_policy="ignore")


def test_booleans_given_as_strings_are_parsed_not_truthy() -> None:
    from kvcentric.connector.sglang.settings import SGLangSettings
    from kvcentric.connector.vllm.settings import ConnectorSettings
    from kvcentric.router.config import RouterConfig
    from kvcentric.store.mooncake.config import MooncakeSettings

    parsed = StoreConfig.from_dict({"verify_checksums": "false", "prefault": "0"})
    assert parsed.local.prefault is False
    assert StoreConfig.from_dict({"verify_checksums": "yes"}).verify_checksums is True
    s = ConnectorSettings.from_extra_config({"save_decode": "false", "async_copy": "off",
                                             "async_commit": "no", "min_fetch_bytes": "4mb"})
    assert s.save_decode is False and s.async_copy is False and s.async_commit is False
    assert s.min_fetch_bytes == 4 << 20 and s.spare_cpu_threads is True
    with pytest.raises(ValueError, match="min_fetch_bytes"):
        ConnectorSettings.from_extra_config({"min_fetch_bytes": 0})
    parsed = StoreConfig.from_dict({"shared_index": "off", "lease_ttl_s": 5})
    assert parsed.local.shared_index is False
    with pytest.raises(ValueError, match="lease_ttl_s"):
        StoreConfig.from_dict({"lease_ttl_s": -1})
    assert MooncakeSettings.from_dict({"ranged_reads": "false"}).ranged_reads is False
    assert SGLangSettings.from_extra_config({"interface_v1": "1"}).v1 is True
    r = RouterConfig.from_dict({"model": "m", "tokenizer": "t", "slo": {"reject": "false"}})
    assert r.slo.reject is False
    for bad in ({"prefault": "maybe"}, {"autostart": 2}):
        with pytest.raises(ValueError, match="must be true or false"):
            StoreConfig.from_dict(bad)


@pytest.mark.parametrize("parse,raw,section", [
    ("store", {"capcity": 1}, "store"),
    ("connector", {"store": {"nme": "x"}}, "store"),
    ("connector", {"save_decodes": True}, "kvcentric connector options"),
    ("sglang", {"kvcentric": {"store": {"bakend": "local"}}}, "store"),
    ("sglang", {"kvcentric": {"modle_id": "m"}}, "kvcentric SGLang options"),
    ("mooncake", {"master": "x"}, "mooncake config"),
    ("router", {"model": "m", "tokenizer": "t", "cost": {"profil": "x"}}, "cost"),
    ("router", {"model": "m", "tokenizer": "t", "instances": [{"url": "http://a:1",
                                                               "rol": "both"}]}, "instance"),
])
def test_unknown_keys_name_the_key_and_the_known_ones(parse: str, raw: dict, section: str
                                                      ) -> None:
    from kvcentric.connector.sglang.settings import SGLangSettings
    from kvcentric.connector.vllm.settings import ConnectorSettings
    from kvcentric.router.config import RouterConfig
    from kvcentric.store.mooncake.config import MooncakeSettings

    parsers = {"store": StoreConfig.from_dict, "connector": ConnectorSettings.from_extra_config,
               "sglang": SGLangSettings.from_extra_config, "mooncake": MooncakeSettings.from_dict,
               "router": RouterConfig.from_dict}
    with pytest.raises(ValueError, match=rf"unknown keys in {section}: \['\w+'\]; known: \[") \
            as err:
        parsers[parse](raw)
    assert str(next(iter(_flat_keys(raw)))) in str(err.value)


def _flat_keys(raw: dict) -> list[str]:
    """The one misspelt key of a test config (the deepest key of its last entry)."""
    key, value = list(raw.items())[-1]
    if isinstance(value, list):
        value = value[0]
    return _flat_keys(value) if isinstance(value, dict) else [key]


@pytest.mark.parametrize("raw", [{"load_timeout_s": "soon"}, {"block_size": 12.5},
                                 {"model_id": 7}])
def test_bad_values_are_value_errors(raw: dict) -> None:
    from kvcentric.connector.vllm.settings import ConnectorSettings

    with pytest.raises(ValueError, match=f"kvcentric connector options.{next(iter(raw))}"):
        ConnectorSettings.from_extra_config(raw)


def test_stored_block_size_rule_is_shared() -> None:
    from kvcentric.stored_layout import dtype_itemsize, stored_block_size

    assert [stored_block_size(p) for p in (16, 32, 48, 128, 256)] == [256, 256, 288, 128, 256]
    assert stored_block_size(16, 512) == 512
    with pytest.raises(ValueError, match="multiple"):
        stored_block_size(128, 200)
    assert [dtype_itemsize(d) for d in ("bfloat16", "torch.float16", "fp8", "half")] == \
        [2, 2, 1, 2]
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        dtype_itemsize("complex64")
