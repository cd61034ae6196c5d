"""Mooncake backend settings: one frozen dataclass, parsed once, ``ValueError`` on bad values.

The names are those of Mooncake's own integrations (``MooncakeConfig``, vLLM's
``MooncakeStoreConnector``, KEP-74): ``master_server_address``, ``metadata_server``,
``protocol``, ``device_name``, ``global_segment_size``, ``local_buffer_size``,
``local_hostname``, ``replica_num``. Values come from, lowest priority first:

1. defaults (a loopback master at ``127.0.0.1:50051``, ``P2PHANDSHAKE``, tcp, a pure client);
2. KEP-74 environment variables: ``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``,
   ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (e.g. ``"16gb"``), ``MOONCAKE_LOCAL_BUFFER_SIZE``,
   ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``, ``MOONCAKE_LOCAL_HOSTNAME``,
   ``MOONCAKE_REPLICA_NUM``;
3. a JSON file: the ``config_path`` key, else ``MOONCAKE_CONFIG_PATH``;
4. the mapping given (the connector's ``store.mooncake`` extra config).

``use_env: false`` in the mapping ignores 2 and ``MOONCAKE_CONFIG_PATH``. This module is the
only place of the Mooncake backend that reads (or, for the transfer engine, sets) environment
variables.

A ``global_segment_size`` of 0 makes a pure client (its objects live in other processes'
segments, e.g. ``kvcentric store mooncake-node``); a ``local_buffer_size`` of 0 is rounded
up to Mooncake's minimum, as KEP-74 storage nodes do.

What these settings cannot give: Mooncake authenticates nobody. Any process that reaches
the master's RPC port can list, overwrite and remove every object; any that reaches a
segment's transfer engine reads and writes the memory it lends, and every client's
transfer engine listens on all interfaces. So the store's own ``verify_checksums``
(:class:`kvcentric.config.StoreConfig`) is on by default for this backend: an object
changed on the way or in a segment is a failed read (the engine recomputes), never KV.
A checksum does not stop a peer that computes one, nor reads, nor deletions: confine the
ports to the group (the NetworkPolicies of ``deploy/kubernetes``). Every client of one
cluster must agree on ``verify_checksums`` (:mod:`kvcentric.store.mooncake.checksums`);
``false`` on a trusted network restores ranged (layer-wise) reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcentric.config import is_loopback, parse_bool, parse_fields

P2P = "P2PHANDSHAKE"
DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_METRICS_PORT = 9003
MIN_LOCAL_BUFFER = 16 << 20
MIN_SEGMENT = 16 << 20  # Mooncake refuses smaller segments

# env var -> field (KEP-74 names, plus the two Mooncake's MooncakeConfig also reads)
ENV_VARS = {
    "MOONCAKE_MASTER": "master_server_address",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "device_name",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_REPLICA_NUM": "replica_num",
}
_SIZES = ("global_segment_size", "local_buffer_size", "staging_size")
_NULLABLE = ("device_name", "tenant_id", "preferred_segment")
_METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://")
# keys of Mooncake's and vLLM's config files that mean nothing to this client
_EXTRA_KEYS = {"config_path", "use_env", "mode", "enable_offload"}


@dataclass(frozen=True)
class MooncakeSettings:
    """How to reach and join a Mooncake Store cluster.

    Fields:
        master_server_address: ``host:port`` of ``mooncake_master``'s RPC service.
        metadata_server: ``"P2PHANDSHAKE"`` (no metadata service) or an ``http://`` URL of
            a metadata server (e.g. the master's ``http://host:8080/metadata``).
        protocol: ``"tcp"`` or ``"rdma"``.
        device_name: RDMA NICs, comma separated; empty with rdma = discover them.
        global_segment_size: bytes this process contributes to the pool (0: pure client).
        local_buffer_size: Mooncake's own registered client buffer.
        local_hostname: address other nodes reach this process at.
        replica_num: copies of every object.
        staging_size: registered memory for in-place writes (``batch_alloc``) and in-place
            reads (``batch_acquire``); bounds one step's saves plus loads.
        fallback_to_tcp: with rdma and no usable RDMA NIC, use tcp instead of failing.
        no_space_wait_s: a put refused for space is retried this long while the master's
            eviction (asynchronous, at its high watermark) frees room.
        probe_interval_s / probe_timeout_s: health monitor period and TCP probe timeout.
        metrics_url: the master's Prometheus endpoint (default: master host, port 9003).
        tenant_id: Mooncake tenant (namespace) of this client.
        preferred_segment: where puts should place objects: ``""`` (the master decides),
            ``"local"`` (this client's own segment, so its puts and gets are local copies;
            needs ``global_segment_size`` > 0) or a segment name ``host:port``.
        ranged_reads: serve streamed reads (``batch_acquire_streamed``) with Mooncake's
            get session and one ranged get per ``fetch_range``, so the connector loads
            layer by layer under compute; false: one whole ``batch_get_into`` up front.
        ssd_offload_path: Mooncake's own SSD tier: a directory where this process's
            segment offloads objects the master evicts from memory (its client setup's
            ``enable_ssd_offload``/``ssd_offload_path``; the master must run with
            ``--enable_offload``, e.g. ``kvcentric store mooncake-master --offload``).
            Empty: no offload. Only meaningful with ``global_segment_size`` > 0, and that
            segment must hold 4 offload buckets (:func:`offload_bucket_problem`).
    """

    master_server_address: str = DEFAULT_MASTER
    metadata_server: str = P2P
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 0
    local_buffer_size: int = 64 << 20
    local_hostname: str = "127.0.0.1"
    replica_num: int = 1
    staging_size: int = 256 << 20
    fallback_to_tcp: bool = False
    no_space_wait_s: float = 0.25
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.5
    metrics_url: str = ""
    tenant_id: str = "default"
    preferred_segment: str = ""
    ranged_reads: bool = True
    ssd_offload_path: str = ""

    def __post_init__(self) -> None:
        host, _ = split_host_port(self.master_server_address)
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        meta = self.metadata_server
        if meta != P2P and not meta.startswith(_METADATA_SCHEMES):
            raise ValueError(f"metadata_server must be {P2P!r} or an http:// URL, got {meta!r}")
        if 0 < self.global_segment_size < MIN_SEGMENT:
            raise ValueError(f"global_segment_size must be 0 (a pure client) or at least "
                             f"{MIN_SEGMENT >> 20} MiB (Mooncake's minimum)")
        if self.preferred_segment == "local" and not self.global_segment_size:
            raise ValueError("preferred_segment 'local' needs a global_segment_size > 0")
        if self.ssd_offload_path and not self.global_segment_size:
            raise ValueError("ssd_offload_path needs a global_segment_size > 0 (a pure "
                             "client has no segment to offload)")
        if self.replica_num < 1:
            raise ValueError("replica_num must be >= 1")
        if self.staging_size <= 0:
            raise ValueError("staging_size must be positive")
        if self.no_space_wait_s < 0:
            raise ValueError("no_space_wait_s must be >= 0")
        if self.probe_interval_s <= 0 or self.probe_timeout_s <= 0:
            raise ValueError("probe_interval_s and probe_timeout_s must be > 0")
        if not self.local_hostname:
            raise ValueError("local_hostname must not be empty")
        if not self.metrics_url:
            object.__setattr__(self, "metrics_url",
                               f"http://{host}:{DEFAULT_METRICS_PORT}/metrics")
        object.__setattr__(self, "local_buffer_size",
                           max(self.local_buffer_size, MIN_LOCAL_BUFFER))

    @property
    def master_host_port(self) -> tuple[str, int]:
        return split_host_port(self.master_server_address)

    @classmethod
    def load(cls, raw: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
             ) -> MooncakeSettings:
        """Merge defaults, env (``os.environ`` unless ``env`` is given), file and ``raw``."""
        raw = dict(raw or {})
        use_env = parse_bool(raw.pop("use_env", True), "mooncake.use_env")
        env = dict(os.environ if env is None else env) if use_env else {}
        merged: dict[str, Any] = {f: env[k] for k, f in ENV_VARS.items() if env.get(k)}
        path = raw.pop("config_path", None) or env.get("MOONCAKE_CONFIG_PATH")
        if path:
            merged |= _read_file(Path(path))
        merged |= raw
        return cls.from_dict(merged)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
                     ) -> MooncakeSettings:
        """The store registry's name for :meth:`load` (``kvcentric.store.backends``)."""
        return cls.load(raw, env)

    def to_mapping(self) -> dict[str, Any]:
        """Every field, as :meth:`from_dict` (and so :meth:`load` with ``use_env: false``)
        reads it back to an equal object."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MooncakeSettings:
        # Mooncake's own files carry _EXTRA_KEYS (they mean nothing here) and null names
        raw = {k: v for k, v in raw.items() if v is not None or k not in _NULLABLE}
        kw = parse_fields(cls, raw, "mooncake config", sizes=_SIZES, ignore=_EXTRA_KEYS)
        if "protocol" in kw:
            kw["protocol"] = str(kw["protocol"]).strip().lower()
        return cls(**kw)


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ``ValueError`` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def engine_env(settings: MooncakeSettings) -> dict[str, str]:
    """Environment Mooncake's transfer engine needs for ``settings`` (not yet set).

    With a metadata server, the engine binds its RPC listener to the first non-loopback
    address unless ``MC_TCP_BIND_ADDRESS`` says otherwise; on a loopback-only host (a test
    namespace) there is none, so bind to ``local_hostname``.
    """
    if settings.metadata_server == P2P or not is_loopback(settings.local_hostname):
        return {}
    if os.environ.get("MC_TCP_BIND_ADDRESS"):
        return {}
    return {"MC_TCP_BIND_ADDRESS": settings.local_hostname}


OFFLOAD_BUCKET_ENV = "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES"
OFFLOAD_BUCKET_DEFAULT = 256 << 20  # Mooncake's bucket backend default


def offload_bucket_problem(settings: MooncakeSettings,
                           env: Mapping[str, str] | None = None) -> str | None:
    """Why ``settings``' SSD offload would wedge its segment, or None.

    Mooncake's offload writes objects to disk in buckets and keeps a queued object in
    memory, unevictable, until its bucket fills (``OFFLOAD_BUCKET_ENV``, 256 MiB by
    default, read by Mooncake from the environment). A segment smaller than a few buckets
    then fills with queued objects and refuses every put (the CPU wheel does, with a
    16 MiB segment), so such a client must set a smaller bucket first.
    """
    if not settings.ssd_offload_path:
        return None
    env = os.environ if env is None else env
    raw = env.get(OFFLOAD_BUCKET_ENV, "")
    bucket = int(raw) if raw.isdigit() else OFFLOAD_BUCKET_DEFAULT
    if settings.global_segment_size >= 4 * bucket:
        return None
    return (f"ssd_offload_path with a {settings.global_segment_size >> 20} MiB segment: "
            f"Mooncake offloads in buckets of {bucket >> 20} MiB ({OFFLOAD_BUCKET_ENV}) and "
            "keeps queued objects in memory until a bucket fills, so this segment would "
            f"stop evicting; set {OFFLOAD_BUCKET_ENV} to at most a quarter of the segment "
            "(and MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT to match) in the environment")


def offload_env(settings: MooncakeSettings,
                env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment a storage node's own process sets for its SSD offload (what is not set
    yet): buckets of an eighth of the segment (at most Mooncake's 256 MiB), so no more than
    that waits in memory for its disk write, and the offload heartbeat every second (10 s by
    default: the segment can fill and refuse puts between two heartbeats)."""
    if not settings.ssd_offload_path:
        return {}
    env = os.environ if env is None else env
    bucket = min(OFFLOAD_BUCKET_DEFAULT, settings.global_segment_size // 8)
    want = {OFFLOAD_BUCKET_ENV: str(bucket),
            "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": str(min(500, max(1, bucket >> 16))),
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1"}
    return {k: v for k, v in want.items() if not env.get(k)}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read mooncake config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"mooncake config file {path} must hold a JSON object")
    return data
