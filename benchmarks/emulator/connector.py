"""Store hits for emulated engines through the real local store, as our connector has them.

The kvcentric connector looks a request's blocks up in the store when the scheduler
first sees it (the leading run of stored blocks, and the prompt's tail after them: then
everything but the last token is a hit), loads what goes beyond the engine's own cached
pages, and saves the prompt's blocks and tail at the end of its prefill and the full
blocks of prompt and answer when the request finishes. :class:`StoreHits` does the same
lookups and puts on a real :class:`kvcentric.store.KVStore` with the connector's keys
(:mod:`kvcentric.hashing`: blocks of :func:`kvcentric.stored_layout.stored_block_size`
tokens, seed ``model_id|cache_salt``), so the router's store view sees exactly what it
would with real engines. Objects carry ``object_bytes`` of zeros (the KV is not
emulated); the load *time* is the emulated engine's business (its profile's bandwidth
over the real KV size).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcentric.hashing import KeySpace, block_hashes, hash_seed, prompt_tail
from kvcentric.store import KVStore, StoreUnavailable
from kvcentric.stored_layout import stored_block_size

LAYOUT_SIG = "e0a1e0a1e0a1e0a1"  # any 16 hex digits: the router discovers it (list_keys)


class StoreHits:
    """One process's connector stand-in over ``store`` (shared by its engines).
    ``enabled`` False: no lookups, no saves (engine caches only, as with no connector),
    until it is set again (``POST /emulator/store``)."""

    def __init__(self, store: KVStore, model_id: str, page_size: int,
                 object_bytes: int = 256) -> None:
        self.store = store
        self.enabled = True
        self.model_id = model_id
        self.block_size = stored_block_size(page_size)
        self.keys = KeySpace(model_id, LAYOUT_SIG)
        self.data = np.zeros(max(1, object_bytes), dtype=np.uint8)
        self.lookups = self.puts = self.failures = 0

    def _chain(self, tokens: Sequence[int], salt: str | None
               ) -> tuple[np.ndarray, bytes, list[bytes]]:
        arr = np.asarray(tokens, dtype=np.uint32)
        seed = hash_seed(self.model_id, salt)
        return arr, seed, block_hashes(arr, self.block_size, seed)

    def lookup(self, tokens: Sequence[int], salt: str | None) -> int:
        """Prompt tokens the store can give the engine (at most ``len(tokens) - 1``)."""
        if not self.enabled:
            return 0
        arr, seed, hashes = self._chain(tokens, salt)
        self.lookups += 1
        try:
            keys = self.keys.keys(hashes)
            run = self.store.batch_exists(keys) if keys else 0
            if run == len(hashes):
                tail = prompt_tail(arr, self.block_size, seed, hashes)
                if tail is not None and self.store.batch_exists([self.keys.tail_key(tail)]):
                    return len(arr) - 1
        except (StoreUnavailable, OSError):
            self.failures += 1
            return 0
        return min(run * self.block_size, len(arr) - 1)

    def save(self, tokens: Sequence[int], salt: str | None, with_tail: bool) -> None:
        """Put the full blocks of ``tokens`` the store lacks (and, ``with_tail``, the
        partial last block), each chained to its parent as the connector does."""
        if not self.enabled:
            return
        arr, seed, hashes = self._chain(tokens, salt)
        try:
            keys = self.keys.keys(hashes)
            have = self.store.batch_exists(keys) if keys else 0
            new = keys[have:]
            if with_tail:
                tail = prompt_tail(arr, self.block_size, seed, hashes)
                if tail is not None:
                    new.append(self.keys.tail_key(tail))
            if new:
                parents: list[str | None] = [keys[have - 1] if have else None, *new[:-1]]
                ptr, n = self.data.ctypes.data, self.data.nbytes
                self.store.batch_put_from(new, [ptr] * len(new), [n] * len(new), parents)
                self.puts += len(new)
        except (StoreUnavailable, OSError):
            self.failures += 1
