"""What a vLLM request's KV depends on besides its token ids, per stored block.

vLLM's own prefix cache chains, per block, the request's LoRA adapter (name and path),
the multimodal inputs overlapping the block (their content hashes and offsets) and a
digest of its prompt embeddings (``vllm.v1.core.kv_cache_utils.
generate_block_hash_extra_keys``): the token ids of an image or of prompt embeddings are
placeholders, identical for different inputs. We chain the same keys into our block
hashes (:func:`kvcentric.hashing.extra_digest`), except the cache salt (already our
seed), plus the adapter's revision digest (:mod:`kvcentric.model_revision`): an adapter
replaced under the same name and path never reuses its predecessor's KV.

A request whose extra keys cannot be computed or encoded is *unkeyable*: the connector
neither loads nor saves it (:class:`Unkeyable`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvcentric.hashing import extra_digest
from kvcentric.model_revision import RevisionCache


class Unkeyable(Exception):
    """This request's KV depends on inputs its keys cannot name."""


def has_extras(request: Any) -> bool:
    """True when the request's KV depends on more than its token ids and cache salt."""
    return bool(request.lora_request is not None or request.mm_features
                or request.prompt_embeds is not None)


class ExtraKeys:
    """Per-block extra-key digests of requests (one per scheduler; thread-compatible)."""

    def __init__(self) -> None:
        self._revisions = RevisionCache()

    def digest(self, request: Any, start: int, end: int) -> bytes | None:
        """The :func:`~kvcentric.hashing.extra_digest` of tokens ``[start, end)`` of
        ``request``; ``Unkeyable`` when it cannot be computed."""
        try:
            keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
            out = [k for k in keys or () if not (isinstance(k, tuple) and k[:1] == ("cache_salt",))]
            lora = request.lora_request
            if lora is not None:
                out.append(("lora_revision", self._revisions.get(str(lora.lora_path))))
            return extra_digest(out)
        except Exception as exc:  # vLLM asserts on features without identifiers, msgpack
            # refuses unknown types: either way the bytes of this KV cannot be named
            raise Unkeyable(f"{type(exc).__name__}: {exc}") from exc
