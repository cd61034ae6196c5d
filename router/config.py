"""Router configuration: one YAML file parsed once into frozen dataclasses.

Every value is checked here (``ValueError`` names the bad field), so nothing later
re-validates. This module and :mod:`kvcentric.router.api.access_config` (the ``auth`` and
``limits`` sections) are the router's only readers of files named by the user at start-up,
and of environment variables: ``KVCENTRIC_ROUTER_UPSTREAM_API_KEY`` (``upstream.api_key``)
here, the keys and the salt secret there; ``os.environ`` is read by :func:`load_config` only.

Example (``configs/router.yaml``)::

    model: tiny                        # served model name; requests for others get 404
    tokenizer: .models/tiny            # model folder: tokenizer, chat template, config.json
    listen: {host: 127.0.0.1, port: 8000}
    instances:
      - {url: http://127.0.0.1:8100, role: both, kv_events: tcp://127.0.0.1:5601}
    slo: {ttft_ms: 2000, tbt_ms: 200}
    store: {backend: local, name: default}
    keys: {block_size: 256, layout_sig: null}
    cost: {profile: profile.json, store_bandwidth_gbps: 5, disk_bandwidth_gbps: 2}
    policy: algorithm1                 # routing policy (kvcentric.router.policies.POLICIES)
    replication: {enabled: true, min_heat: 4, max_replicas: 4}
    auth: {api_keys: {sk-team-a: team-a}, admin_key: sk-admin, metrics_key: sk-metrics,
           salt_secret_file: /run/secrets/kvc-salt}
    limits: {max_body_bytes: 4mb, max_prompt_tokens: 8192, max_tokens: 2048,
             max_concurrency_per_key: 64}
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvcentric.config import StoreConfig, check_keys, parse_fields
from kvcentric.router.api.access_config import AuthConfig, LimitsConfig
from kvcentric.router.api.access_config import check_positive as _positive
from kvcentric.router.cost.processor import SHARING
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.seq_hash import check_seed
from kvcentric.store.backends import get_backend

__all__ = ["AuthConfig", "LimitsConfig", "RouterConfig", "load_config"]
ENV_UPSTREAM_KEY = "KVCENTRIC_ROUTER_UPSTREAM_API_KEY"
# predicted TTFTs within this fraction of the lowest are ties (the cost model's noise)
TIE_TOLERANCE = 0.05
# Algorithm 1 is greedy: a hot prefix's holder always predicts the lowest TTFT, so without
# a bound its running batch grows while engines without the prefix idle, and the holder's
# decodes slow every prefill it takes (no-store hot-prefix fleet runs, results/)
BALANCE_ABS = 4
BALANCE_REL = 1.5
# a colocated prefill's compute, charged once per request decoding beside it: each of its
# chunked steps is a gap in their streams (see kvcentric.router.cost.decision)
STALL_WEIGHT = 1.0
# the request's own prefill work, charged once: a prefix recomputed on an idle instance
# while its first prefill still runs on its holder costs the fleet that compute again,
# which the requests after it wait for (see kvcentric.router.cost.decision)
WORK_WEIGHT = 1.0


def _section(cls: type, section: str, raw: Any) -> Any:
    return cls(**parse_fields(cls, raw, section))


@dataclass(frozen=True)
class SloConfig:
    """Service levels. ``reject``: a request predicted to miss the TTFT SLO because of
    queueing is refused with 429 and ``Retry-After`` (Mooncake's early rejection); false
    serves it best effort (flagged ``over_slo``), for clients that cannot retry, e.g. a
    conversation that ends on a refused turn."""

    ttft_ms: float = 2000.0
    tbt_ms: float = 200.0
    reject: bool = True

    def __post_init__(self) -> None:
        _positive(self, "ttft_ms", "tbt_ms")
        if not isinstance(self.reject, bool):
            raise ValueError(f"slo.reject must be true or false, got {self.reject!r}")


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if not 0 <= int(self.port) < 65536:
            raise ValueError(f"listen.port {self.port} is out of range")


@dataclass(frozen=True)
class KeysConfig:
    """How the router names blocks; must equal the connector's settings.

    ``block_size``: tokens per stored block, the connector's ``block_size``. ``None``: the
    connector's own default for the page size the engines report in their ``/metrics``
    (:func:`kvcentric.stored_layout.stored_block_size`: 128 on vLLM CPU), found at the first
    health check. ``layout_sig``: the engines' layout signature (part of every key).
    ``None`` discovers it once from the keys the engines stored (``list_keys``), see
    :mod:`kvcentric.router.fleet.store_view`. ``model_id``: key namespace; ``None`` uses the
    served model name, like the connector.
    """

    block_size: int | None = None
    model_id: str | None = None
    layout_sig: str | None = None
    tp_size: int = 1

    def __post_init__(self) -> None:
        _positive(self, "tp_size")
        if self.block_size is not None:
            _positive(self, "block_size")
        if self.layout_sig is not None and not re.fullmatch(r"[0-9a-f]{16}", self.layout_sig):
            raise ValueError(f"keys.layout_sig {self.layout_sig!r} must be 16 hex chars")


@dataclass(frozen=True)
class CostConfig:
    """Cost model inputs (Mooncake Algorithm 1).

    ``profile``: JSON from ``kvcentric-router profile`` (``T_prefill`` fit and TBT model);
    ``None`` uses the conservative defaults of :class:`router.cost.cost_model.Profile`.
    ``store_bandwidth_gbps``: measured read bandwidth of the store tier (GB/s, DRAM); a
    value in the profile overrides it. ``disk_bandwidth_gbps``: read bandwidth of the local
    store's disk tier (GB/s) for blocks the store holds only on disk; the profile's
    (``kvcentric-router profile --disk-path``) overrides it. ``kv_bytes_per_token``:
    ``None`` derives it from the model's ``config.json``. ``shared_compute``: how
    instances naming one ``compute`` share it: ``serial`` (one FIFO: time-sliced engines,
    CPU engines on the same cores) or ``fair`` (split among the busy ones: engines sharing
    a GPU through MPS); see :mod:`kvcentric.router.cost.processor`. ``tie_tolerance``:
    predicted TTFTs within this fraction of the lowest are ties, which go to the least
    loaded candidate (:func:`kvcentric.router.cost.decision.choose`); 0 takes the lowest.
    ``balance_abs`` and ``balance_rel``: an instance running more than ``balance_abs``
    sequences beyond the least loaded candidate, and more than ``balance_rel`` times as
    many, is not a candidate (``balance_abs: null`` turns this off); see
    :func:`kvcentric.router.cost.decision.choose`. ``stall_weight``: seconds of TTFT one
    second of a colocated prefill's compute costs each of this router's requests on that
    instance, which all decode through it (the choice minimises TTFT plus that stall; 0:
    TTFT alone). ``work_weight``: seconds of score one second of the request's own prefill
    work (load and compute) costs on top of its TTFT: the fleet's capacity a recomputed
    prefix takes from the requests after it (0: none). ``wait_for_landing``: a request
    whose prefix an in-flight prefill is computing (not yet in the store) may be held
    until that prefill stores it and then load it on an idle instance, where it would
    otherwise queue behind the prefill or compute the prefix again
    (:mod:`kvcentric.router.fleet.landings`). Off by default: the capacity sweeps
    measured no consistent gain from it (docs/router.md).
    """

    profile: str | None = None
    store_bandwidth_gbps: float = 5.0
    disk_bandwidth_gbps: float = 2.0
    kv_bytes_per_token: int | None = None
    kv_dtype: str | None = None
    correct_with_actual: bool = True
    shared_compute: str = "serial"
    tie_tolerance: float = TIE_TOLERANCE
    balance_abs: int | None = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    stall_weight: float = STALL_WEIGHT
    work_weight: float = WORK_WEIGHT
    wait_for_landing: bool = False

    def __post_init__(self) -> None:
        _positive(self, "store_bandwidth_gbps", "disk_bandwidth_gbps")
        if not isinstance(self.wait_for_landing, bool):
            raise ValueError(f"cost.wait_for_landing must be true or false, got "
                             f"{self.wait_for_landing!r}")
        for name in ("stall_weight", "work_weight"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
                raise ValueError(f"cost.{name} must be a number >= 0, got {w!r}")
        ab, rel = self.balance_abs, self.balance_rel
        if ab is not None and (isinstance(ab, bool) or not isinstance(ab, int) or ab < 0):
            raise ValueError(f"cost.balance_abs must be an integer >= 0 or null, got {ab!r}")
        if isinstance(rel, bool) or not isinstance(rel, (int, float)) or not 1 <= rel < math.inf:
            raise ValueError(f"cost.balance_rel must be a number >= 1, got {rel!r}")
        tol = self.tie_tolerance
        if (not isinstance(tol, (int, float)) or isinstance(tol, bool)
                or not 0 <= tol < 1):
            raise ValueError(f"cost.tie_tolerance must be a number in [0, 1), got {tol!r}")
        if self.shared_compute not in SHARING:
            raise ValueError(f"cost.shared_compute must be one of {SHARING}, got "
                             f"{self.shared_compute!r}")
        if self.kv_bytes_per_token is not None:
            _positive(self, "kv_bytes_per_token")


@dataclass(frozen=True)
class HealthConfig:
    """Polling of the engines: ``/health`` every ``interval_s`` (failure detection: an
    instance leaves rotation after ``unhealthy_after`` failed checks), ``/metrics`` at most
    every ``metrics_interval_s`` (its gauges only correct the router's own in-flight
    bookkeeping, and rendering the ~60 KB page costs the engine's API process CPU it
    shares with decode; read at once when an instance joins or comes back).
    ``log_interval_s``: a failing instance is logged (URL and reason) at its first failed
    check and then at most this often while it keeps failing. ``passive``: an instance in
    rotation whose answer to a routed request started within the last ``interval_s``
    is not asked for ``/health`` except with its ``/metrics`` poll (the answer is the
    check: a busy fleet's engines are asked every ``metrics_interval_s``, which still
    sees one that reports itself unhealthy while answering; an idle one's as before)."""

    interval_s: float = 1.0
    metrics_interval_s: float = 5.0
    timeout_s: float = 2.0
    unhealthy_after: int = 2
    log_interval_s: float = 60.0
    passive: bool = True

    def __post_init__(self) -> None:
        _positive(self, "interval_s", "metrics_interval_s", "timeout_s", "unhealthy_after",
                  "log_interval_s")


@dataclass(frozen=True)
class UpstreamConfig:
    """Proxying: ``timeout_s`` bounds one upstream call; ``retries`` other instances tried.
    ``api_key``: sent to the engines as ``Authorization: Bearer`` (engines started with
    ``--api-key``); ``None``: without router keys the client's own header is forwarded,
    with router keys none is."""

    timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    retries: int = 1
    api_key: str | None = None

    def __post_init__(self) -> None:
        _positive(self, "timeout_s", "connect_timeout_s")
        if self.retries < 0:
            raise ValueError("upstream.retries must be >= 0")


@dataclass(frozen=True)
class CacheConfig:
    """Prefix knowledge: per-instance LRU size (blocks, unless the engine reports its own),
    TTLs of the global store view, the decay time of prefix heat, and how many characters
    of prompt text the router keeps tokenised (``prompt_text_chars``; 0: tokenise every
    prompt whole; :mod:`kvcentric.router.prefix_tokens`). ``scan_prompts``: tokenise a
    text prompt only up to its first block held nowhere (:mod:`kvcentric.router.prompt_scan`;
    needs the prompt text cache); false: every prompt whole."""

    blocks_per_instance: int = 4096
    store_ttl_s: float = 2.0
    store_negative_ttl_s: float = 0.25
    heat_half_life_s: float = 60.0
    prompt_text_chars: int = 16 * 2**20
    scan_prompts: bool = True

    def __post_init__(self) -> None:
        _positive(self, "blocks_per_instance", "store_ttl_s", "store_negative_ttl_s",
                  "heat_half_life_s")
        if self.prompt_text_chars < 0:
            raise ValueError("cache.prompt_text_chars must be >= 0")
        if not isinstance(self.scan_prompts, bool):
            raise ValueError(f"cache.scan_prompts must be true or false, got "
                             f"{self.scan_prompts!r}")


@dataclass(frozen=True)
class ReplicationConfig:
    """Hot-prefix replication (:mod:`router.fleet.replication`), on unless ``enabled`` is
    false: without it a hot prefix gets a new holder only when every holder runs past
    Algorithm 1's load bound (:class:`CostConfig`), and that request pays the recompute;
    warm-ups add holders ahead of demand (docs/router.md §Hot-prefix replication has the
    measurements).

    A prefix is hot from ``min_heat`` (its decayed request count, ``cache.heat_half_life_s``).
    An idle instance is warmed with it when its predicted TTFT for the prefix's requests,
    once it holds the prefix, beats the best holder's by more than ``min_gain`` (a
    fraction). Bounds: ``max_inflight`` warm requests at a time, one started per
    ``interval_s``, at most ``max_replicas`` holders per prefix, the ``top_prefixes``
    hottest looked at, and one instance warmed with one prefix at most once per
    ``cooldown_s`` (a replica the engine evicted is not kept warm)."""

    enabled: bool = True
    interval_s: float = 0.5
    min_heat: float = 4.0
    min_gain: float = 0.2
    # warm-ups go only to idle processors, so several at once slow no engine; one at a
    # time added one replica per prefill of the prefix (8 engines, no store: 4.6 s each,
    # the last two never warmed in the hot-prefix fleet run)
    max_inflight: int = 4
    max_replicas: int = 8
    top_prefixes: int = 8
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"replication.enabled must be true or false, got {self.enabled!r}")
        _positive(self, "interval_s", "min_heat", "max_inflight", "max_replicas",
                  "top_prefixes", "cooldown_s")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) \
                or self.min_gain < 0:
            raise ValueError(f"replication.min_gain must be >= 0, got {self.min_gain!r}")


@dataclass(frozen=True)
class MemoryConfig:
    """The router's own memory: every ``trim_interval_s`` seconds the heap pages glibc
    holds free go back to the system (:mod:`kvcentric.router.ops.memory`; 0: never), and
    glibc makes at most ``malloc_arenas`` malloc arenas (0: its default, 8 per core). The
    bookkeeping itself is bounded elsewhere (``cache.prompt_text_chars``, the engines'
    capacities)."""

    trim_interval_s: float = 60.0
    malloc_arenas: int = 2

    def __post_init__(self) -> None:
        t = self.trim_interval_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 or t != t:
            raise ValueError(f"memory.trim_interval_s must be >= 0, got {t!r}")
        a = self.malloc_arenas
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ValueError(f"memory.malloc_arenas must be an integer >= 0, got {a!r}")


_PEER_ENDPOINT = re.compile(r"^(tcp://[^\s:/]+:\d{1,5}|ipc:///[^\s]+)$")


@dataclass(frozen=True)
class PeersConfig:
    """Router replicas in front of one fleet telling each other their dispatches
    (:mod:`kvcentric.router.fleet.peers`): ``publish`` the ZMQ endpoint this replica binds
    (``tcp://HOST:PORT`` or ``ipc:///path``; loopback unless ``allow_remote``),
    ``connect`` the other replicas' endpoints. Off when both are empty."""

    publish: str | None = None
    connect: tuple[str, ...] = ()
    allow_remote: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.connect, (list, str)):
            object.__setattr__(self, "connect", tuple(
                [self.connect] if isinstance(self.connect, str) else self.connect))
        for ep in (*([self.publish] if self.publish else []), *self.connect):
            if not isinstance(ep, str) or not _PEER_ENDPOINT.match(ep):
                raise ValueError(f"peers endpoint {ep!r} must be tcp://HOST:PORT or "
                                 "ipc:///path")
        if self.publish and self.publish.startswith("tcp://") and not self.allow_remote:
            host = self.publish[len("tcp://"):].rsplit(":", 1)[0]
            if not _loopback(host):
                raise ValueError(f"peers.publish {self.publish} is not a loopback address: "
                                 "set peers.allow_remote: true (and keep the port on a "
                                 "network only the replicas reach)")

    @property
    def enabled(self) -> bool:
        return bool(self.publish or self.connect)


_STORE_EVENTS = re.compile(r"^(tcp://[^\s*/:]+:\d{1,5}|tcp://\[[0-9a-fA-F:.]+\]:\d{1,5}"
                           r"|ipc:///\S+)$")


@dataclass(frozen=True)
class StoreEventsConfig:
    """The store's own KV events as the router's view of it
    (:mod:`kvcentric.router.fleet.store_events`, docs/router.md §Store residency): ``endpoint``
    the store's PUB socket (a Mooncake master's ``kv_events_bind_endpoint``, or our local
    store's ``store.events.endpoint``; the store binds, the router connects),
    ``replay_endpoint`` its replay socket (or null), ``max_keys`` remembered. Off when
    ``endpoint`` is unset; then the router asks the store (``store``) per request."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    max_keys: int = 1 << 22

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            ep = getattr(self, name)
            if ep is not None and (not isinstance(ep, str) or not _STORE_EVENTS.match(ep)):
                raise ValueError(f"store_events.{name} must be the store's address, "
                                 f"tcp://HOST:PORT or ipc:///PATH (no wildcard), got {ep!r}")
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("store_events.replay_endpoint needs store_events.endpoint")
        _positive(self, "max_keys")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


@dataclass(frozen=True)
class IndexerConfig:
    """Mooncake's Conductor indexer API on the router (:mod:`kvcentric.router.api.indexer_routes`,
    docs/router.md §Indexer API): ``seed`` of the standard XXH3-64 sequence hashes
    (:mod:`kvcentric.seq_hash`; publishers and queriers must use the same),
    ``max_publishers`` registered at once, ``max_blocks_per_publisher`` remembered per
    publisher (its oldest forgotten first), ``max_query_blocks`` per query."""

    seed: int = 0
    max_publishers: int = 1024
    max_blocks_per_publisher: int = 1 << 20
    max_query_blocks: int = 1 << 16

    def __post_init__(self) -> None:
        check_seed(self.seed)
        _positive(self, "max_publishers", "max_blocks_per_publisher", "max_query_blocks")


@dataclass(frozen=True)
class RouterConfig:
    model: str
    tokenizer: str
    instances: tuple[InstanceSpec, ...] = ()
    slo: SloConfig = field(default_factory=SloConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    store: StoreConfig | None = None
    keys: KeysConfig = field(default_factory=KeysConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    indexer: IndexerConfig = field(default_factory=IndexerConfig)
    store_events: StoreEventsConfig = field(default_factory=StoreEventsConfig)
    # the routing policy by its registered name (:mod:`kvcentric.router.policies`)
    policy: str = "algorithm1"
    log_level: str = "info"

    def __post_init__(self) -> None:
        # imported here: the policies import this module (SloConfig) for their inputs
        from kvcentric.router.policies import check_policy

        check_policy(self.policy)
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model (the served model name) is required")
        if not self.tokenizer:
            raise ValueError("tokenizer (the model folder) is required")
        names = [i.name for i in self.instances]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique, got {names}")
        if not (_loopback(self.listen.host) or self.auth.enabled or self.auth.allow_open):
            raise ValueError(f"refusing to listen on {self.listen.host} without API keys: "
                             "set auth.api_keys (or auth.allow_open: true to run open)")

    @property
    def model_id(self) -> str:
        return self.keys.model_id or self.model

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any],
                  env: Mapping[str, str] | None = None) -> RouterConfig:
        """Parse a YAML mapping (relative paths stay relative to the working directory);
        ``env``: the environment variables to honour (see the module docstring)."""
        if not isinstance(raw, Mapping):
            raise ValueError("the router config must be a mapping")
        for required in ("model", "tokenizer"):
            if not isinstance(raw.get(required), str) or not raw[required]:
                raise ValueError(f"{required} is required (a non-empty string)")
        check_keys(cls, raw, "router config")
        raw = dict(raw)
        for name, cls_ in (("slo", SloConfig), ("listen", ListenConfig), ("keys", KeysConfig),
                           ("cost", CostConfig), ("health", HealthConfig),
                           ("upstream", UpstreamConfig), ("cache", CacheConfig),
                           ("replication", ReplicationConfig), ("peers", PeersConfig),
                           ("memory", MemoryConfig), ("indexer", IndexerConfig),
                           ("store_events", StoreEventsConfig)):
            raw[name] = _section(cls_, name, raw.get(name))
        insts = raw.get("instances") or []
        if not isinstance(insts, list):
            raise ValueError("instances must be a list of {url, role}")
        raw["instances"] = tuple(InstanceSpec.from_dict(i) for i in insts)
        raw["store"] = _store(raw.get("store"))
        env = env or {}
        raw["auth"] = AuthConfig.parse(raw.get("auth"), env)
        if env.get(ENV_UPSTREAM_KEY):
            raw["upstream"] = replace(raw["upstream"], api_key=env[ENV_UPSTREAM_KEY])
        raw["limits"] = LimitsConfig.parse(raw.get("limits"))
        return cls(**raw)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to be loopback
        return False


def _store(raw: Any) -> StoreConfig | None:
    """The store as for the connector, opened passively (its backend's ``passive``: the
    router never starts a local coordinator and never prefaults its arena)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError("store must be a mapping like the connector's store config")
    cfg = StoreConfig.from_dict({"op_timeout_s": 1.0, **raw})
    return get_backend(cfg.backend).passive(cfg)


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a router YAML file; relative paths are relative to the cwd."""
    text = Path(path).read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    return RouterConfig.from_dict(raw or {}, os.environ)
