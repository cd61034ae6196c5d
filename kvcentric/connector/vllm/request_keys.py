"""The store keys of one request's objects, on the scheduler side of the vLLM connector.

A request's stored block ``i`` is keyed by the chain hash of its tokens up to the block's
end, seeded by the model and the request's ``cache_salt``, with everything else vLLM's own
prefix cache hashes besides token ids folded in per block (LoRA, multimodal inputs, prompt
embeddings: :mod:`kvcentric.connector.vllm.extra_keys`). Its *tail* (the partial last
block) and a hybrid model's recurrent state at a block boundary are keyed from the same
chain (:func:`kvcentric.hashing.prompt_tail`). Each method raises ``Unkeyable`` when the
request's extra keys cannot be computed: such a request is neither loaded nor saved.

:class:`RequestKeys` belongs to one request: it caches the hashes computed so far (a
chain only grows; later calls hash only the new blocks), so the lookup, the load and every
later step's saves pay for each block once. Workers turn an
:class:`~kvcentric.integrity.ObjectRef` into each TP rank's key.
"""

from __future__ import annotations

from typing import Any

from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.extra_keys import ExtraKeys, has_extras
from kvcentric.hashing import block_hashes, hash_seed, prompt_tail
from kvcentric.integrity import ObjectRef


class RequestKeys:
    """The objects of ``request`` (vLLM's ``Request``: ``all_token_ids``, ``cache_salt``
    and the inputs ``extra_keys`` reads) under ``layout``; ``extra_keys`` is the
    scheduler's shared digest cache. Blocks are ``layout.stored_block_size`` tokens."""

    def __init__(self, request: Any, layout: EngineLayout, extra_keys: ExtraKeys) -> None:
        self.request = request
        self.layout = layout
        self._extra_keys = extra_keys
        self.extras = has_extras(request)  # its KV depends on more than its tokens
        self._hashes: list[bytes] = []

    def _seed(self) -> bytes:
        return hash_seed(self.layout.keyspace.model_id, self.request.cache_salt)

    def _extra(self, start: int, end: int) -> bytes | None:
        return self._extra_keys.digest(self.request, start, end) if self.extras else None

    def hashes(self, num_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first ``num_blocks`` stored blocks."""
        have = len(self._hashes)
        if num_blocks > have:
            s = self.layout.stored_block_size
            toks = self.request.all_token_ids[have * s : num_blocks * s]
            extras = ([self._extra(i * s, (i + 1) * s) for i in range(have, num_blocks)]
                      if self.extras else None)
            self._hashes.extend(block_hashes(toks, s, self._seed(), extras=extras,
                                             parent=self._hashes[-1] if self._hashes else None))
        return self._hashes[:num_blocks]

    def blocks(self, first: int, end: int) -> list[ObjectRef]:
        """Objects of stored blocks ``[first, end)``."""
        s = self.layout.stored_block_size
        return [ObjectRef(h, first + i, s) for i, h in enumerate(self.hashes(end)[first:])]

    def tail(self, end: int) -> ObjectRef | None:
        """The tail object of the request's first ``end`` tokens, None under 2 tokens past
        the last full block or when the engine stores no tails (a recurrent group's state
        exists at block boundaries only)."""
        if not self.layout.tails:
            return None
        s = self.layout.stored_block_size
        full = end // s
        extra = self._extra(full * s, end) if end - full * s >= 2 else None
        tail = prompt_tail(self.request.all_token_ids[:end], s, self._seed(),
                           self.hashes(full), extra)
        return None if tail is None else ObjectRef(tail.digest, full, tail.count, tail=True)

    def state(self, end: int) -> ObjectRef:
        """The recurrent state after the request's first ``end`` tokens (a stored-block
        boundary), keyed by the chain hash of the block that ends there."""
        s = self.layout.stored_block_size
        return ObjectRef(self.hashes(end // s)[-1], end // s - 1, s, state=True)

    def objects(self, num_tokens: int) -> list[ObjectRef]:
        """The stored objects of the request's first ``num_tokens`` tokens: its full
        blocks, then its tail."""
        refs = self.blocks(0, num_tokens // self.layout.stored_block_size)
        tail = self.tail(num_tokens)
        return refs + ([tail] if tail is not None else [])
