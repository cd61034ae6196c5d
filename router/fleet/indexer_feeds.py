"""Publishers registered with the standard indexer, and their events turned into residency.

A registration (``POST /register``, docs/router.md §Indexer API) names a ZMQ publisher and
what its events mean: the model, LoRA adapter, tenant, block size, salt and DP rank they
are scoped by, and the ``instance_id`` requests for those blocks go to. Three wire formats
arrive the same way, vLLM's three-frame batches ``(topic, seq: u64 BE, msgpack [ts,
events, dp_rank])`` (:class:`kvcentric.router.fleet.kv_events.EventListener` receives them and
replays gaps):

- ``vLLM`` and ``SGLang``: tagged maps ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``, ``lora_name``, and
  vLLM's ``extra_keys`` or SGLang's ``cache_salt``), ``BlockRemoved``, ``AllBlocksCleared``.
  Their hashes are the engine's own, so the standard sequence hashes are recomputed from
  the token ids, each engine hash remembered (bounded) to find a child's parent and to
  resolve removals. A page size other than the registered ``block_size``, an unknown
  parent, or multimodal extra keys make an event unindexable: it is counted, not guessed.
- ``Mooncake`` (its master's publisher, or any pool publishing standard hashes): RFC #1527 maps
  (``event_type`` ``stored``/``removed``/``cleared``, ``seq_hashes``, ``parent_hash``,
  ``base_block_idx``, ``token_ids``, ``medium``, ``tenant_id``, ``backend_id``). These
  are shared pools: their blocks count for every instance of the scope.

Nothing a publisher sends can stop the listener or grow memory without bound: a malformed
event is counted in ``skipped`` and dropped; entries live in the index's per-publisher LRU.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcentric.router.fleet.indexer import GPU, Owner, Scope, TierIndex
from kvcentric.router.fleet.kv_events import EventListener
from kvcentric.seq_hash import seq_hashes

log = logging.getLogger("router.fleet.indexer")

ENGINE_TYPES = ("vLLM", "SGLang")
POOL_TYPES = ("Mooncake",)
PUBLISHER_TYPES = (*ENGINE_TYPES, *POOL_TYPES)
_U64 = 2**64
_MEDIA = {"cpu_pinned": "cpu"}  # SGLang's host tier is "CPU_PINNED"


@dataclass(frozen=True)
class Registration:
    """One ``POST /register`` body, checked (see docs/router.md §Indexer API)."""

    endpoint: str
    type: str
    model: str
    instance_id: str
    block_size: int
    dp_rank: int
    replay_endpoint: str | None = None
    lora_name: str = ""
    tenant_id: str = "default"
    salt: str = ""

    @property
    def key(self) -> str:
        """What ``/unregister`` names a registration by (Mooncake's form)."""
        return f"{self.instance_id}|{self.tenant_id}|{self.dp_rank}"

    @property
    def pool(self) -> bool:
        """A shared store's publisher rather than an engine's."""
        return self.type in POOL_TYPES

    def scope(self, lora_name: str | None = None, salt: str | None = None,
              tenant_id: str | None = None) -> Scope:
        return Scope(self.model, self.lora_name if lora_name is None else lora_name,
                     self.block_size, self.salt if salt is None else salt,
                     self.tenant_id if tenant_id is None else tenant_id)

    def describe(self) -> dict[str, Any]:
        """The registration in the API's own field names."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "type": self.type, "modelname": self.model, "lora_name": self.lora_name,
                "tenant_id": self.tenant_id, "instance_id": self.instance_id,
                "block_size": self.block_size, "dp_rank": self.dp_rank,
                "additionalsalt": self.salt}


def medium_of(raw: Any, default: str) -> str:
    """An event's medium in lower case (SGLang's ``CPU_PINNED`` is ``cpu``)."""
    if not isinstance(raw, str) or not raw:
        return default
    m = raw.lower()
    return _MEDIA.get(m, m)


def _u64_list(values: Any) -> list[int] | None:
    if not isinstance(values, list):
        return None
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U64:
            return None
    return values


class Publisher:
    """One registration's event stream applied to a :class:`TierIndex`.

    ``on_events`` is the listener's callback (one batch's events, in order). ``max_pages``
    bounds the engine hashes remembered for parents and removals (engine publishers).
    """

    def __init__(self, reg: Registration, index: TierIndex, seed: int,
                 max_pages: int) -> None:
        self.reg = reg
        self.index = index
        self.seed = seed
        self.max_pages = max_pages
        # engine hash -> the sequence hash of the block it stored, and its scope (one
        # object per event, shared by its pages: no object of their own per page for the
        # garbage collector to track)
        self._pages: OrderedDict[Any, int] = OrderedDict()
        self._scope_of: dict[Any, Scope] = {}
        self.listener: EventListener | None = None
        self.stored = 0
        self.removed = 0
        self.skipped = 0
        self.last_event_id: int | None = None

    def on_events(self, events: list[dict[str, Any]]) -> None:
        apply: Callable[[dict[str, Any]], bool] = (
            self._standard if self.reg.pool else self._engine)
        for ev in events:
            if not apply(ev):
                self.skipped += 1

    # ---- vLLM / SGLang ----
    def _engine(self, ev: dict[str, Any]) -> bool:
        kind = ev.get("type")
        if kind == "BlockStored":
            return self._engine_stored(ev)
        if kind == "BlockRemoved":
            hashes = ev.get("block_hashes")
            if not isinstance(hashes, list):
                return False
            owner = self._owner(medium_of(ev.get("medium"), GPU))
            for h in hashes:
                seq = self._pages.pop(h, None) if _hashable(h) else None
                if seq is not None:
                    self.index.remove(self.reg.key, self._scope_of.pop(h), (seq,), owner)
                    self.removed += 1
            return True
        if kind == "AllBlocksCleared":
            self._pages.clear()
            self._scope_of.clear()
            self.index.clear(self.reg.key)
            return True
        return False

    def _engine_stored(self, ev: dict[str, Any]) -> bool:
        hashes, tokens, page = ev.get("block_hashes"), ev.get("token_ids"), ev.get("block_size")
        parent = ev.get("parent_block_hash")
        if (not isinstance(hashes, list) or not hashes or not isinstance(tokens, list)
                or page != self.reg.block_size or len(tokens) != page * len(hashes)
                or not all(h is not None and _hashable(h) for h in hashes)
                or not _hashable(parent)):
            return False
        salt = ev.get("cache_salt")
        extra = ev.get("extra_keys") or []
        if not isinstance(extra, list):
            return False
        for keys in extra:  # vLLM: per block; strings are the salt or adapter, else mm
            if keys and not (isinstance(keys, list)
                             and all(isinstance(k, str) for k in keys)):
                return False
        lora = ev.get("lora_name")
        if parent is None:
            if salt is None and extra and extra[0]:
                salt = next((k for k in extra[0] if k != lora), None)
            scope = self.reg.scope(lora_name=lora if isinstance(lora, str) else None,
                                   salt=salt if isinstance(salt, str) else None)
            chain: int | None = None
        else:
            chain = self._pages.get(parent)
            if chain is None:
                return False
            scope = self._scope_of[parent]
        try:
            seqs = seq_hashes(tokens, page, self.seed, parent=chain)
        except (ValueError, TypeError, OverflowError):
            return False
        owner = self._owner(medium_of(ev.get("medium"), GPU))
        self.index.store(self.reg.key, scope, seqs, owner)
        pages, scope_of = self._pages, self._scope_of
        for h, s in zip(hashes, seqs, strict=True):
            pages[h] = s
            pages.move_to_end(h)
            scope_of[h] = scope
        while len(pages) > self.max_pages:
            del scope_of[pages.popitem(last=False)[0]]
        self.stored += len(seqs)
        return True

    def _owner(self, medium: str, backend: str | None = None) -> Owner:
        if self.reg.pool:
            return Owner(backend or self.reg.instance_id, medium)
        return Owner(self.reg.instance_id, medium, self.reg.instance_id, self.reg.dp_rank)

    # ---- RFC #1527 (Mooncake master, kvcentric store) ----
    def _standard(self, ev: dict[str, Any]) -> bool:
        kind = ev.get("event_type")
        event_id = ev.get("event_id")
        if isinstance(event_id, int) and not isinstance(event_id, bool):
            self.last_event_id = event_id
        backend = ev.get("backend_id")
        owner = self._owner(medium_of(ev.get("medium"), "cpu"),
                            backend if isinstance(backend, str) and backend else None)
        scope = self._standard_scope(ev)
        if scope is None:
            return False
        if kind == "cleared":
            self.index.clear(self.reg.key, owner.medium if ev.get("medium") else None)
            return True
        hashes = _u64_list(ev.get("seq_hashes"))
        if hashes is None:
            return False
        if kind == "removed":
            self.index.remove(self.reg.key, scope, hashes, owner)
            self.removed += len(hashes)
            return True
        if kind != "stored":
            return False
        tokens = ev.get("token_ids")
        if not hashes and isinstance(tokens, list) and tokens:
            parent = ev.get("parent_hash")
            if parent is not None and _u64_list([parent]) is None:
                return False
            try:
                hashes = seq_hashes(tokens, scope.block_size, self.seed, parent=parent)
            except (ValueError, TypeError, OverflowError):
                return False
        self.index.store(self.reg.key, scope, hashes, owner)
        self.stored += len(hashes)
        return True

    def _standard_scope(self, ev: dict[str, Any]) -> Scope | None:
        """The event's envelope over the registration's: a field the event carries must
        agree with the registration where the registration fixes it (model, block size)."""
        model, size = ev.get("model_name"), ev.get("block_size")
        if model is not None and model != self.reg.model:
            return None
        if size is not None and size != self.reg.block_size:
            return None
        lora, salt, tenant = ev.get("lora_name"), ev.get("additional_salt"), ev.get("tenant_id")
        return self.reg.scope(lora_name=lora if isinstance(lora, str) else None,
                              salt=salt if isinstance(salt, str) else None,
                              tenant_id=tenant if isinstance(tenant, str) and tenant else None)

    def describe(self) -> dict[str, Any]:
        out = self.reg.describe()
        lst = self.listener
        out.update(stored=self.stored, removed=self.removed, skipped=self.skipped,
                   entries=self.index.entries(self.reg.key),
                   batches=lst.batches if lst else 0, gaps=lst.gaps if lst else 0,
                   replayed=lst.replayed if lst else 0,
                   malformed=lst.malformed if lst else 0)
        return out


def _hashable(h: Any) -> bool:
    """Engine block hashes are ints or bytes (None: no parent)."""
    return h is None or isinstance(h, (int, bytes, str)) and not isinstance(h, bool)


