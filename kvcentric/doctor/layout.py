"""The doctor's engine-facing checks: which keys an engine really writes, and whether the
router's config agrees with its engines.

The zero-hit trap: engines share a stored block only when their keys are equal, and a key
folds in the model id, the layout signature (layers, block size, heads, dtype, memory
layout, CPU ISA) and the TP rank/size. Rather than re-deriving a signature from outside
(the ISA and memory layout are only known inside the engine), :func:`check_layout` asks the
engine: one completion of a few stored blocks under a fresh ``cache_salt`` (so it can
collide with nothing), then the store is searched for the key of its first block under
every candidate model id and block size. That key says what this engine writes; the keys
already stored say what it could hit. The probe's own objects are removed afterwards
(local store; on Mooncake they age out).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvcentric.config import EngineEnv, StoreConfig
from kvcentric.doctor.findings import FAIL, OK, WARN, Finding
from kvcentric.hashing import KEY_PREFIX, block_hashes, hash_seed, prompt_tail
from kvcentric.stored_layout import stored_block_size

KEY_LIMIT = 1_000_000
PROBE_WAIT_S = 10.0


@dataclass(frozen=True)
class EngineInfo:
    """What an engine's ``/v1/models`` and ``/metrics`` say."""

    url: str
    models: tuple[str, ...]
    max_model_len: int | None
    page_size: int | None


@dataclass(frozen=True)
class ProbeResult:
    """The keys one engine writes: ``kvc/v2/{model_id}/{layout_sig}/{rank}/...``."""

    url: str
    model_id: str
    layout_sig: str
    rank: str
    block_size: int


def _auth() -> dict[str, str]:
    """The engines' API key: vLLM's own variable, or the one deploy/kubernetes gives the
    router pod."""
    key = EngineEnv.from_environ().api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def engine_info(url: str) -> EngineInfo:
    """Served model names, context length and page size of the engine at ``url``;
    ``httpx.HTTPError`` / ``ValueError`` when it does not answer as vLLM does."""
    import httpx  # the router extra's; a plain install's doctor never asks an engine

    base = url.rstrip("/")
    r = httpx.get(base + "/v1/models", headers=_auth(), timeout=10)
    r.raise_for_status()
    data = r.json()["data"]
    models = tuple(str(m["id"]) for m in data)
    max_len = next((int(m["max_model_len"]) for m in data if m.get("max_model_len")), None)
    page = None
    text = httpx.get(base + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                size = s.labels.get("block_size", "")
                page = int(size) if size.isdigit() else page
    return EngineInfo(base, models, max_len, page)


def split_key(key: str) -> tuple[str, str, str, str] | None:
    """``(model_id, layout_sig, rank, leaf)`` of a kvcentric key (model ids may hold '/')."""
    if not key.startswith(KEY_PREFIX + "/"):
        return None
    parts = key[len(KEY_PREFIX) + 1:].split("/")
    if len(parts) < 4:
        return None
    return "/".join(parts[:-3]), parts[-3], parts[-2], parts[-1]


def list_keys(cfg: StoreConfig, prefix: str = KEY_PREFIX + "/") -> list[str]:
    """Keys under ``prefix``, as the store's backend lists them (local: the coordinator;
    Mooncake: the master's key dump)."""
    from kvcentric.store.backends import BACKENDS

    return BACKENDS[cfg.backend].list_keys(cfg, prefix, KEY_LIMIT)


def _remove(cfg: StoreConfig, keys: Iterable[str]) -> None:
    from kvcentric.store.backends import BACKENDS

    BACKENDS[cfg.backend].remove_keys(cfg, list(keys))


def probe_tokens(n: int) -> list[int]:
    return [10 + (i * 7919) % 997 for i in range(n)]


def _probe_length(info: EngineInfo) -> int:
    default = stored_block_size(info.page_size or 16)
    want = max(2 * default, 1024) + 1
    return min(want, (info.max_model_len or want + 2) - 2)


def _candidates(tokens: list[int], page: int, model_ids: Iterable[str], salt: str
                ) -> dict[str, tuple[str, int]]:
    """First-block hash (hex) -> (model_id, block size) for every page multiple."""
    out = {}
    for m in model_ids:
        seed = hash_seed(m, salt)
        for size in range(page, len(tokens), page):
            out[block_hashes(tokens[:size], size, seed)[0].hex()] = (m, size)
    return out


def _send_probe(info: EngineInfo, tokens: list[int], salt: str) -> None:
    import httpx

    body = {"model": info.models[0], "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
            "cache_salt": salt}
    r = httpx.post(info.url + "/v1/completions", json=body, headers=_auth(), timeout=120)
    r.raise_for_status()


def _find_probe(cfg: StoreConfig, cands: dict[str, tuple[str, int]]) -> tuple[str, ...] | None:
    deadline = time.monotonic() + PROBE_WAIT_S
    while True:
        for key in list_keys(cfg):
            parts = split_key(key)
            if parts and parts[3] in cands:
                return parts
        if time.monotonic() > deadline:
            return None
        time.sleep(0.25)


def _probe_keys(probe: ProbeResult, tokens: list[int], salt: str) -> list[str]:
    seed = hash_seed(probe.model_id, salt)
    chain = block_hashes(tokens, probe.block_size, seed)
    prefix = f"{KEY_PREFIX}/{probe.model_id}/{probe.layout_sig}/{probe.rank}/"
    keys = [prefix + h.hex() for h in chain]
    tail = prompt_tail(tokens, probe.block_size, seed, chain)
    if tail is not None:
        keys.append(f"{prefix}t{tail.count}-{tail.digest.hex()}")
    return keys


def run_probe(cfg: StoreConfig, url: str) -> tuple[ProbeResult | None, list[str], str]:
    """Send the probe; ``(result, keys stored before it, why it found nothing)``."""
    info = engine_info(url)
    if not info.models:
        return None, [], f"engine at {url} serves no model"
    before = list_keys(cfg)
    tokens = probe_tokens(_probe_length(info))
    salt = f"kvc-doctor-{uuid.uuid4().hex}"
    ids = {info.models[0]} | {p[0] for p in map(split_key, before) if p}
    cands = _candidates(tokens, info.page_size or 16, ids, salt)
    _send_probe(info, tokens, salt)
    found = _find_probe(cfg, cands)
    if found is None:
        return None, before, (f"the engine at {url} wrote no block of a {len(tokens)}-token "
                              f"prompt into this store ({cfg.backend} {cfg.name!r})")
    model_id, size = cands[found[3]]
    result = ProbeResult(info.url, model_id, found[1], found[2], size)
    _remove(cfg, _probe_keys(result, tokens, salt))
    return result, before, ""


def check_layout(cfg: StoreConfig, url: str) -> tuple[Finding, ProbeResult | None]:
    """The layout this engine writes against the layouts the store holds for its model."""
    import httpx

    from kvcentric.store import StoreUnavailable

    try:
        probe, before, why = run_probe(cfg, url)
    except (httpx.HTTPError, ValueError, KeyError, StoreUnavailable, OSError) as exc:
        return Finding("layout-signature", FAIL, f"cannot probe the engine at {url} "
                       f"against the store: {exc}", "check --url and --store"), None
    if probe is None:
        return Finding("layout-signature", FAIL, why + ": it does not save there (no "
                       "connector, a different store name, runtime_dir or Mooncake master, "
                       "or kv_role kv_consumer: then probe a producer instead), so nothing "
                       "it computes is shared",
                       "give the engine's kv_connector_extra_config the same store as "
                       "the router and the other engines"), None
    mine = f"{probe.layout_sig}/{probe.rank}"
    held: Counter[str] = Counter()
    models: Counter[str] = Counter()
    for parts in filter(None, map(split_key, before)):
        models[parts[0]] += 1
        if parts[0] == probe.model_id:
            held[f"{parts[1]}/{parts[2]}"] += 1
    details = {"engine_writes": f"{KEY_PREFIX}/{probe.model_id}/{mine}/",
               "block_size": probe.block_size, "store_layouts": dict(held),
               "store_models": dict(models)}
    other = {k: n for k, n in held.items() if k != mine}
    fix = ("give every engine that should share KV the same model_id, block_size, dtype, "
           "KV layout, CPU ISA and TP size; clear the stale objects or pin the router's "
           "keys.layout_sig to the layout in use")
    if other and not held.get(mine):
        return Finding("layout-signature", FAIL, f"zero-hit trap: the store holds "
                       f"{sum(other.values())} blocks of {probe.model_id} under "
                       f"{sorted(other)}, and this engine writes {mine}: it can never "
                       "load them", fix, details), probe
    if other:
        return Finding("layout-signature", WARN, f"the store holds {probe.model_id} "
                       f"blocks of several layouts ({sorted(held)}); this engine shares "
                       f"only those of {mine}", fix, details), probe
    if not held and models:
        return Finding("layout-signature", WARN, f"the store holds no block of model id "
                       f"{probe.model_id!r}, only of {sorted(models)}: engines sharing "
                       "with this one must use the same model_id", fix, details), probe
    return Finding("layout-signature", OK, f"engine writes {details['engine_writes']} "
                   f"({probe.block_size}-token blocks); store holds {held.get(mine, 0)} "
                   "blocks of that layout and none of another", details=details), probe
