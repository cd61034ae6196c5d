"""The store's residency from its KV events, instead of asking it per request.

With ``store_events`` configured (docs/router.md §Store residency), the router subscribes
to a store's RFC #1527 event stream: a Mooncake master's (``enable_kv_events``, which
names each object by its key, ``object_key``) or our local store's (store.md §KV
events). Every ``stored``/``removed``/``cleared`` event whose ``object_key`` is one of
this model's rank-0 keys updates which keys the store holds and on which tiers (``cpu``,
``disk``); :class:`~kvcentric.router.fleet.store_view.StoreView` then answers a prompt's leading
run from here, with no store call on the request path. The key layout is the configured
``keys.layout_sig`` or the first one seen in the events (as ``StoreView`` discovers it
from ``list_keys``).

Bounded: at most ``max_keys`` keys are remembered (the least recently stored forgotten
first: a forgotten key reads as absent, which costs a recompute, never a wrong token).
Single-threaded: the router's event loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvcentric.hashing import KEY_PREFIX, KeySpace, TailRef

log = logging.getLogger("router.fleet.store_events")
DISK = "disk"


class StoreFeed:
    """Which of this model's keys the store holds, per tier, from its events."""

    def __init__(self, model_id: str, layout_sig: str | None, tp_size: int = 1,
                 max_keys: int = 1 << 22) -> None:
        self.model_id = model_id
        self.tp_size = tp_size
        self.max_keys = max_keys
        self.keyspace = KeySpace(model_id, layout_sig, 0, tp_size) if layout_sig else None
        self._prefix = f"{KEY_PREFIX}/{model_id}/"
        self._held: OrderedDict[str, set[str]] = OrderedDict()  # key -> media
        self.applied = 0
        self.skipped = 0  # events of the wrong shape
        self.foreign = 0  # other models', layouts', ranks' keys
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._held)

    def on_events(self, events: list[dict[str, Any]]) -> None:
        """One batch's events, in order (the listener's callback)."""
        for ev in events:
            kind, medium = ev.get("event_type"), ev.get("medium")
            if kind == "cleared":
                self._clear(medium if isinstance(medium, str) else None)
                self.applied += 1
                continue
            key = ev.get("object_key")
            if kind not in ("stored", "removed") or not isinstance(key, str) \
                    or not isinstance(medium, str):
                self.skipped += 1
                continue
            if not self._ours(key):
                self.foreign += 1
                continue
            self.applied += 1
            if kind == "stored":
                media = self._held.get(key)
                if media is None:
                    self._held[key] = {medium.lower()}
                else:
                    media.add(medium.lower())
                    self._held.move_to_end(key)
                while len(self._held) > self.max_keys:
                    self._held.popitem(last=False)
                    self.forgotten += 1
            else:
                media = self._held.get(key)
                if media is not None:
                    media.discard(medium.lower())
                    if not media:
                        del self._held[key]

    def _ours(self, key: str) -> bool:
        """A rank-0 key of this model in the (configured or first seen) layout."""
        if not key.startswith(self._prefix):
            return False
        if self.keyspace is None:
            sig, _, rest = key[len(self._prefix):].partition("/")
            if not sig or not rest.startswith(f"0of{self.tp_size}/"):
                return False
            self.keyspace = KeySpace(self.model_id, sig, 0, self.tp_size)
            log.info("store key layout for %s seen in the store's events: %s",
                     self.model_id, sig)
        return key.startswith(self.keyspace.prefix)

    def _clear(self, medium: str | None) -> None:
        if medium is None:
            self._held.clear()
            return
        m = medium.lower()
        for key in [k for k, media in self._held.items() if m in media]:
            media = self._held[key]
            media.discard(m)
            if not media:
                del self._held[key]

    def residency(self, hashes: Sequence[bytes | TailRef]) -> tuple[int, tuple[int, ...]]:
        """``(run, disk_only)``: the leading items of ``hashes`` the store holds, and the
        positions among them it holds only on disk."""
        ks = self.keyspace
        if ks is None:
            return 0, ()
        run, disk = 0, []
        for i, h in enumerate(hashes):
            media = self._held.get(ks.key_of(h))
            if not media:
                break
            if media == {DISK}:
                disk.append(i)
            run += 1
        return run, tuple(disk)
