"""Mooncake backend pieces that need no cluster: config sources and validation, error-code
mapping, RDMA device discovery and choice, the staging arena."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import (
    ERR_CORRUPT,
    ERR_EXISTS,
    ERR_HAS_LEASE,
    ERR_INVALID,
    ERR_NO_SPACE,
    ERR_NOT_FOUND,
    ERR_TRANSFER,
    ERR_UNAVAILABLE,
)
from kvcentric.store.mooncake.config import (
    MooncakeSettings,
    engine_env,
    offload_bucket_problem,
    offload_env,
    split_host_port,
)
from kvcentric.store.mooncake.rdma import (
    RdmaDevice,
    RdmaUnavailable,
    _from_sysfs,
    choose,
    cpu_numa_node,
    resolve_transport,
)
from kvcentric.store.mooncake.staging import StagingArena

KEP74 = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
         "MOONCAKE_GLOBAL_SEGMENT_SIZE": "16gb", "MOONCAKE_LOCAL_BUFFER_SIZE": "512mb",
         "MOONCAKE_PROTOCOL": "RDMA", "MOONCAKE_DEVICE": "mlx5_0,mlx5_1"}


def test_kep74_env_vars() -> None:
    s = MooncakeSettings.load({}, env=KEP74)
    assert s.master_server_address == "10.0.0.1:50051" and s.metadata_server == "P2PHANDSHAKE"
    assert s.global_segment_size == 16 << 30 and s.local_buffer_size == 512 << 20
    assert s.protocol == "rdma" and s.device_name == "mlx5_0,mlx5_1"
    assert s.metrics_url == "http://10.0.0.1:9003/metrics"


def test_precedence_defaults_env_file_mapping(tmp_path: Path) -> None:
    f = tmp_path / "mooncake.json"  # a vLLM MooncakeStoreConnector file works as is
    f.write_text(json.dumps({"master_server_address": "10.0.0.2:50051", "protocol": "tcp",
                             "metadata_server": "http://10.0.0.2:8080/metadata",
                             "global_segment_size": 0, "mode": "standalone-store",
                             "local_buffer_size": "1gb"}))
    s = MooncakeSettings.load({"global_segment_size": "2gb"},
                              env=KEP74 | {"MOONCAKE_CONFIG_PATH": str(f)})
    assert s.master_server_address == "10.0.0.2:50051" and s.protocol == "tcp"  # file > env
    assert s.device_name == "mlx5_0,mlx5_1"  # env > default
    assert s.global_segment_size == 2 << 30  # mapping > file
    assert MooncakeSettings.load({"use_env": False}, env=KEP74) == MooncakeSettings()
    s = MooncakeSettings.load({"config_path": str(f), "use_env": False}, env=KEP74)
    assert s.local_buffer_size == 1 << 30 and s.device_name == ""


def test_defaults_are_a_loopback_pure_client() -> None:
    s = MooncakeSettings()
    assert (s.master_server_address, s.metadata_server, s.protocol, s.global_segment_size) == \
        ("127.0.0.1:50051", "P2PHANDSHAKE", "tcp", 0)
    assert StoreConfig.from_dict({"backend": "mooncake"}).mooncake == MooncakeSettings.load(None)
    assert s.ranged_reads  # layer-wise loads unless turned off
    assert not MooncakeSettings.load({"use_env": False, "ranged_reads": "false"}).ranged_reads


@pytest.mark.parametrize("bad, match", [
    ({"protocol": "udp"}, "protocol"),
    ({"master_server_address": "nohost"}, "host:port"),
    ({"master_server_address": "h:99999"}, "host:port"),
    ({"metadata_server": "ftp://x"}, "metadata_server"),
    ({"replica_num": 0}, "replica_num"),
    ({"global_segment_size": "lots"}, "invalid size"),
    ({"global_segment_size": -1}, "size"),
    ({"global_segment_size": "1mb"}, "16 MiB"),
    ({"masterr": "x"}, r"unknown keys in mooncake config: \[.masterr.\]"),
    ({"fallback_to_tcp": "maybe"}, "true or false"),
    ({"ranged_reads": "sometimes"}, "true or false"),
    ({"probe_interval_s": 0}, "probe_interval_s"),
    ({"ssd_offload_path": "/tmp/ssd"}, "ssd_offload_path needs a global_segment_size"),
])
def test_bad_values_raise(bad: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MooncakeSettings.load({"use_env": False, **bad})


def test_shipped_configs_parse() -> None:
    from kvcentric.connector.vllm.settings import ConnectorSettings
    root = Path(__file__).resolve().parents[2] / "configs"
    client = MooncakeSettings.load({"config_path": str(root / "mooncake-store.json"),
                                    "use_env": False})
    assert client.global_segment_size == 0 and client.metadata_server == "P2PHANDSHAKE"
    node = MooncakeSettings.load({"config_path": str(root / "mooncake-node.json"),
                                  "use_env": False})
    assert node.global_segment_size == 4 << 30
    kv = json.loads((root / "mooncake-kv-transfer.json").read_text())
    settings = ConnectorSettings.from_extra_config(kv["kv_connector_extra_config"])
    assert settings.store.backend == "mooncake"


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read mooncake config file"):
        MooncakeSettings.load({"config_path": str(tmp_path / "none.json")})


def test_checksum_trailers_seal_and_check() -> None:
    """The trailer holds ``checksum()`` of the object's buffers together; a flipped byte,
    a short or a long object is ``ERR_CORRUPT``; a failed get passes through."""
    import numpy as np

    from kvcentric.store import ERR_CORRUPT, ERR_NOT_FOUND, checksum
    from kvcentric.store.mooncake.checksums import TRAILER, Trailers, read_trailer
    from kvcentric.store.mooncake.staging import StagingArena

    arena = StagingArena(1 << 20, lambda ptr, size: 0)
    a = np.arange(3000, dtype=np.uint8)
    b = np.arange(5000, dtype=np.uint8)[::-1].copy()
    whole = np.concatenate([a, b])
    t = Trailers(arena, 2)
    ptrs, sizes = t.seal([[a.ctypes.data, b.ctypes.data], [b.ctypes.data]], [[3000, 5000], [5000]])
    assert sizes == [[3000, 5000, TRAILER], [5000, TRAILER]]
    assert read_trailer(t.ptrs[0]) == checksum(whole.ctypes.data, whole.nbytes)
    assert t.check(0, [whole.ctypes.data], [8000], 8000 + TRAILER) == 8000
    assert t.check(1, [b.ctypes.data], [6000], 5000 + TRAILER) == 5000  # bound, not size
    assert t.check(0, [whole.ctypes.data], [8000], 7000 + TRAILER) == ERR_CORRUPT
    assert t.check(0, [whole.ctypes.data], [8000], 9000 + TRAILER) == ERR_CORRUPT
    assert t.check(0, [whole.ctypes.data], [8000], ERR_NOT_FOUND) == ERR_NOT_FOUND
    whole[10] ^= 1
    assert t.check(0, [whole.ctypes.data], [8000], 8000 + TRAILER) == ERR_CORRUPT
    t.free()
    assert arena.used == 0
    arena.close()


def test_engine_env_binds_loopback_only_with_a_metadata_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    http = MooncakeSettings(metadata_server="http://127.0.0.1:8080/metadata")
    assert engine_env(http) == {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    assert engine_env(MooncakeSettings()) == {}  # P2PHANDSHAKE binds local_hostname itself
    assert engine_env(MooncakeSettings(metadata_server=http.metadata_server,
                                       local_hostname="10.1.2.3")) == {}
    assert split_host_port("[::1]:50051") == ("::1", 50051)


def test_error_codes_map_to_the_contract() -> None:
    from kvcentric.store.mooncake.codes import map_code
    assert [map_code(c) for c in (0, 4096, -200, -704, -703, -705, -706, -707, -800, -801,
                                  -900, -1010, -600, -1)] == \
        [0, 4096, ERR_NO_SPACE, ERR_NOT_FOUND, ERR_NOT_FOUND, ERR_EXISTS, ERR_HAS_LEASE,
         ERR_TRANSFER, ERR_TRANSFER, ERR_CORRUPT, ERR_UNAVAILABLE, ERR_UNAVAILABLE,
         ERR_INVALID, ERR_TRANSFER]


# ---- RDMA ----
def _fake_sysfs(root: Path, devices: dict[str, tuple[int, list[str]]]) -> Path:
    for name, (numa, states) in devices.items():
        (root / name / "device").mkdir(parents=True)
        (root / name / "device" / "numa_node").write_text(f"{numa}\n")
        for port, state in enumerate(states, 1):
            (root / name / "ports" / str(port)).mkdir(parents=True)
            (root / name / "ports" / str(port) / "state").write_text(state + "\n")
    return root


def test_sysfs_discovery_reads_ports_and_numa(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path, {"mlx5_0": (0, ["4: ACTIVE"]), "mlx5_1": (1, ["1: DOWN",
                                                                              "4: ACTIVE"]),
                                  "mlx5_2": (1, ["1: DOWN"])})
    assert _from_sysfs(root) == [RdmaDevice("mlx5_0", (1,), 0), RdmaDevice("mlx5_1", (2,), 1),
                                 RdmaDevice("mlx5_2", (), 1)]
    assert _from_sysfs(tmp_path / "absent") == []


def test_choose_prefers_active_devices_on_the_local_numa_node() -> None:
    devs = [RdmaDevice("a", (1,), 0), RdmaDevice("b", (1,), 1), RdmaDevice("c", (), 1),
            RdmaDevice("d", (1,), -1)]
    assert choose(devs, 1) == ["b", "d"]
    assert choose(devs, 0) == ["a", "d"]
    assert choose(devs[1:2], 0) == ["b"]  # nothing local: any active device beats none
    assert choose(devs, -1) == ["a", "b", "d"]
    assert choose([RdmaDevice("c", (), 0)], 0) == []


def test_rdma_without_devices_says_so_and_falls_back_only_if_asked() -> None:
    from kvcentric.store.mooncake.rdma import list_devices
    if choose(list_devices()[0], -1):
        pytest.skip("this machine has RDMA devices")
    with pytest.raises(RdmaUnavailable, match="no RDMA device|fallback_to_tcp"):
        resolve_transport("rdma", "", fallback_to_tcp=False)
    assert resolve_transport("rdma", "", fallback_to_tcp=True) == ("tcp", "")
    assert resolve_transport("rdma", "mlx5_0", False) == ("rdma", "mlx5_0")
    assert resolve_transport("tcp", "", False) == ("tcp", "")
    assert cpu_numa_node() >= -1


def test_scatter_gather_calls_are_chunked() -> None:
    from kvcentric.store.mooncake.client import MAX_SLICES, chunks
    lists = [[0] * 16] * 70  # 1120 buffers: two calls
    cs = chunks(lists)
    assert [(c.start, c.stop) for c in cs] == [(0, MAX_SLICES // 16), (MAX_SLICES // 16, 70)]
    assert [(c.start, c.stop) for c in chunks([[0] * 2000, [0]])] == [(0, 1), (1, 2)]
    assert chunks([]) == []


# ---- staging ----
def test_staging_runs_are_contiguous_and_refcounted() -> None:
    registered: list[tuple[int, int]] = []

    def register(ptr: int, size: int) -> int:
        registered.append((ptr, size))
        return 0

    arena = StagingArena(1 << 20, register)
    try:
        assert registered == [(arena.base, 1 << 20)]
        run = arena.alloc_run([4096] * 4)
        assert [p - run[0] for p in run] == [0, 4096, 8192, 12288]
        arena.free(run[:3])
        assert arena.used == 4 * 4096  # the extent lives while one object does
        arena.free(run[3:])
        assert arena.used == 0
        big = arena.alloc_run([600 << 10, 600 << 10])  # no room for both: a leading prefix
        assert len(big) == 1
        arena.free(big + [12345])  # unknown pointers are ignored
        assert arena.used == 0
    finally:
        arena.close()
    with pytest.raises(RuntimeError, match="register_buffer"):
        StagingArena(4096, lambda p, n: -1)


def test_ssd_offload_settings_reach_mooncake_and_small_segments_get_small_buckets() -> None:
    from kvcentric.store.mooncake.service import OFFLOAD_FLAGS, master_command
    assert set(OFFLOAD_FLAGS) <= set(master_command(offload=True))
    assert not set(OFFLOAD_FLAGS) & set(master_command())
    none = MooncakeSettings.load({"use_env": False, "global_segment_size": "64mb"})
    assert offload_env(none, {}) == {} and offload_bucket_problem(none, {}) is None
    node = MooncakeSettings.load({"use_env": False, "global_segment_size": "64mb",
                                  "ssd_offload_path": "/nvme/mc"})
    # Mooncake's 256 MiB buckets would wedge a 64 MiB segment: a clear error for clients...
    assert "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES" in str(offload_bucket_problem(node, {}))
    # ...and a node command sets buckets of 1/8 of its segment unless the user chose
    env = offload_env(node, {})
    assert env["MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES"] == str(8 << 20)
    assert offload_bucket_problem(node, env) is None
    assert "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES" not in offload_env(
        node, {"MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": "4194304"})
    big = MooncakeSettings.load({"use_env": False, "global_segment_size": "4gb",
                                 "ssd_offload_path": "/nvme/mc"})
    assert offload_bucket_problem(big, {}) is None
