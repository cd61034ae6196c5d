"""Chained block hashes and store keys: the one spec every kvcentric process shares.

docs/architecture.md §The key spec:

- Tokens are cut into blocks of ``block_size`` tokens; only full blocks are hashed.
- ``h_0 = H(seed)``, ``h_i = H(h_{i-1} || tokens_i as little-endian u32)``, ``H`` = xxh3_128.
- ``seed`` = UTF-8 of ``model_id | cache_salt`` (the salt is empty by default).
- A block whose KV depends on more than its token ids (a LoRA adapter, multimodal inputs
  overlapping it, prompt embeddings: vLLM's "extra keys") chains that too:
  ``h_i = H(h_{i-1} || tokens_i || "kvc-x" || x_i)`` with ``x_i`` = :func:`extra_digest` of
  its extra keys; a block without any hashes exactly as above.
- key = ``kvc/v2/{model_id}/{space_sig}/{tp_rank}of{tp_size}/{h_i hex}``, where
  ``space_sig`` is the layout signature (:mod:`kvcentric.stored_layout`, which also folds
  in the model's revision). ``v2``: every object starts with an integrity header
  (:mod:`kvcentric.integrity`).
- A partial last block (a *tail*, ``count`` < ``block_size`` tokens) is keyed
  ``.../t{count}-{tail_hash hex}`` with :func:`tail_hash` over its parent chain hash and its
  exact tokens (and its extra keys' digest, when it has one).

Hashes depend only on the inputs, never on Python's hash seed, the process or the machine,
so the connector, the router and the benchmarks agree on every block.
``tests/data/hash_vectors.json`` holds published test vectors.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import xxhash

KEY_PREFIX = "kvc/v2"
_MAX_TOKEN_ID = 2**32 - 1


def hash_seed(model_id: str, cache_salt: str | None = None) -> bytes:
    """Return the seed bytes ``model_id | cache_salt`` (UTF-8) that start every chain."""
    if not model_id:
        raise ValueError("model_id must be a non-empty string")
    return f"{model_id}|{cache_salt or ''}".encode()


def root_hash(seed: bytes) -> bytes:
    """``h_0 = xxh3_128(seed)`` as 16 big-endian digest bytes."""
    return xxhash.xxh3_128_digest(seed)


_EXTRA_TAG = b"kvc-x"
_extras_encoder = msgspec.msgpack.Encoder()


def extra_digest(extra_keys: Sequence[object] | None) -> bytes | None:
    """xxh3_128 of the canonical msgpack encoding of one block's extra keys (tuples of
    str, int and bytes, e.g. vLLM's ``("lora", name, path)``, ``("mm", hash, offset)``,
    ``("prompt_embeds", sha256)``), or ``None`` when there are none. ``TypeError`` for a
    value msgpack cannot encode canonically (the caller must then not key the block)."""
    if not extra_keys:
        return None
    return xxhash.xxh3_128_digest(_extras_encoder.encode(list(extra_keys)))


_ARRAY_U32 = array.array("I").itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def tokens_le_u32(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as the little-endian u32 bytes the chain hashes; ``ValueError`` if not
    1-D or out of ``[0, 2**32)``. A list or tuple of ints goes through :mod:`array`
    (~6 ns per token; numpy's conversion of a Python list takes ~60): the router
    converts every KV event's token ids."""
    if _ARRAY_U32 and isinstance(token_ids, (list, tuple)):
        try:
            a = array.array("I", token_ids)
        except OverflowError as exc:
            raise ValueError("token ids must be in [0, 2**32)") from exc
        except TypeError:
            pass  # not plain ints (nested, floats, ...): numpy decides, as it always did
        else:
            if _BIG_ENDIAN:
                a.byteswap()
            return a.tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    seed: bytes,
    *,
    parent: bytes | None = None,
    extras: Sequence[bytes | None] | None = None,
) -> list[bytes]:
    """Chained xxh3_128 digests of the full blocks of ``token_ids``.

    Args:
        token_ids: prompt tokens; a trailing partial block is ignored.
        block_size: tokens per block (> 0).
        seed: chain seed from :func:`hash_seed`.
        parent: digest of the block preceding ``token_ids[0]``; ``None`` means the chain
            starts at ``h_0 = H(seed)``. Lets callers extend a chain incrementally.
        extras: per full block, its :func:`extra_digest` or ``None`` (missing entries:
            ``None``).

    Returns:
        ``[h_1, ..., h_k]`` (16 bytes each) for the ``k = len(token_ids) // block_size`` full
        blocks.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = root_hash(seed) if parent is None else parent
    return extend_chain(prev, tokens_le_u32(token_ids), block_size, extras)[0]


def extend_chain(parent: bytes, raw: bytes, block_size: int,
                 extras: Sequence[bytes | None] | None = None) -> tuple[list[bytes], bytes]:
    """Extend a chain at ``parent`` over ``raw`` (tokens from :func:`tokens_le_u32`).

    Returns the digests ``h_i = H(h_{i-1} || block_i [|| "kvc-x" || extras[i]])`` of the
    full blocks in ``raw`` and the bytes of the trailing partial block (for callers that
    receive tokens piecewise, like the router's KV-event translation).
    """
    nbytes = block_size * 4
    full = (len(raw) // nbytes) * nbytes
    out: list[bytes] = []
    digest = xxhash.xxh3_128_digest
    prev = parent
    for i, start in enumerate(range(0, full, nbytes)):
        x = extras[i] if extras is not None and i < len(extras) else None
        block = raw[start : start + nbytes]
        prev = digest(prev + block if x is None else prev + block + _EXTRA_TAG + x)
        out.append(prev)
    return out, raw[full:]


_TAIL_TAG = b"kvc-tail"


def tail_hash(parent: bytes, tail_tokens: Sequence[int] | np.ndarray,
              extra: bytes | None = None) -> bytes:
    """Digest of a partial last block: ``H(parent || "kvc-tail" || count as LE u32 ||
    tokens as LE u32 [|| "kvc-x" || extra])``, where ``parent`` is the chain hash of the
    full blocks before it (``h_0`` when there are none) and ``extra`` the tail's
    :func:`extra_digest`. The tag and the count keep it apart from every full block and
    from every other tail, even of the same tokens."""
    raw = tokens_le_u32(tail_tokens)
    count = (len(raw) // 4).to_bytes(4, "little")
    body = parent + _TAIL_TAG + count + raw
    return xxhash.xxh3_128_digest(body if extra is None else body + _EXTRA_TAG + extra)


@dataclass(frozen=True)
class TailRef:
    """A prompt's partial last block: its :func:`tail_hash` and token count."""

    digest: bytes
    count: int


def prompt_tail(token_ids: Sequence[int] | np.ndarray, block_size: int, seed: bytes,
                hashes: Sequence[bytes], extra: bytes | None = None) -> TailRef | None:
    """The tail of ``token_ids`` after its full blocks (whose chain is ``hashes``), or
    ``None`` when it holds under 2 tokens: a hit must leave vLLM one token to compute, so
    a 1-token tail can never be loaded. ``extra``: the tail's :func:`extra_digest`."""
    full = len(token_ids) // block_size
    count = len(token_ids) - full * block_size
    if count < 2:
        return None
    parent = hashes[full - 1] if full else root_hash(seed)
    return TailRef(tail_hash(parent, token_ids[full * block_size:], extra), count)


@dataclass(frozen=True)
class KeySpace:
    """Builds store keys for one (model, KV layout, TP rank).

    Two engines share KV only when every field here is equal; ``layout_sig`` folds in
    everything that decides the bytes of a block (see :mod:`kvcentric.stored_layout`).
    """

    model_id: str
    layout_sig: str
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.model_id or "/" in self.layout_sig or not self.layout_sig:
            raise ValueError("model_id and layout_sig must be non-empty; layout_sig has no '/'")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got {self.tp_rank}of{self.tp_size}")

    @property
    def prefix(self) -> str:
        return f"{KEY_PREFIX}/{self.model_id}/{self.layout_sig}/{self.tp_rank}of{self.tp_size}/"

    def key(self, block_hash: bytes) -> str:
        """The object key of one block hash."""
        return self.prefix + block_hash.hex()

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        """Object keys of a chain of block hashes, in order."""
        p = self.prefix
        return [p + h.hex() for h in hashes]

    def tail_key(self, tail: TailRef) -> str:
        """The key of a tail object: ``{prefix}t{count}-{digest hex}``, never equal to a
        block key (32 hex chars)."""
        return f"{self.prefix}t{tail.count}-{tail.digest.hex()}"

    def state_key(self, block_hash: bytes) -> str:
        """The key of the recurrent state at the end of block ``block_hash`` (hybrid
        models): ``{prefix}s-{hex}``, never equal to a block or a tail key."""
        return f"{self.prefix}s-{block_hash.hex()}"

    def key_of(self, item: bytes | TailRef) -> str:
        """The key of a block hash or of a tail."""
        return self.tail_key(item) if isinstance(item, TailRef) else self.key(item)
