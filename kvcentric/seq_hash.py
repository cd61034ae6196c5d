"""The field's standard block hashes (Mooncake RFC #1527, "KV Events API Standardization").

Indexers and routers that speak the standard (Mooncake's Conductor indexer, Dynamo's
standalone indexer) name a prefix of ``block_size``-token blocks by *rolling sequence
hashes*, XXH3-64 with a seed ``S`` shared by publisher and consumer:

- local block hash ``l_i = XXH3_64(tokens of block i as little-endian u32, S)``;
- ``seq_0 = l_0`` and ``seq_i = XXH3_64(seq_{i-1} as LE u64 || l_i as LE u64, S)``.

Only complete blocks are hashed. A ``seq_i`` names the whole prefix up to block ``i``, so
equal prefixes give equal hashes until the first block that differs. These hashes are
not kvcentric's store keys (:mod:`kvcentric.hashing`, xxh3_128 chained from the model and
salt): the model, LoRA, salt and tenant are not in them, they scope the index instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvcentric.hashing import tokens_le_u32

MAX_SEED = 2**64 - 1


def check_seed(seed: int) -> int:
    """``seed`` if it is a u64, else ``ValueError``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"the sequence hash seed must be an integer in [0, 2^64), "
                         f"got {seed!r}")
    return seed


def next_seq_hash(parent: int | None, block_tokens: bytes, seed: int = 0) -> int:
    """The rolling hash of one block, ``block_tokens`` its tokens as LE u32 bytes;
    ``parent`` is the previous block's sequence hash, None for the first block."""
    local = xxhash.xxh3_64_intdigest(block_tokens, seed)
    if parent is None:
        return local
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + local.to_bytes(8, "little"),
                                    seed)


def seq_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0,
               parent: int | None = None) -> list[int]:
    """Sequence hashes of every complete block of ``token_ids``, root first; ``parent``:
    the sequence hash of the block before the first (None: the tokens start the prompt).
    ``ValueError`` for a token id outside u32 or a block size below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = tokens_le_u32(token_ids)
    step = block_size * 4
    out: list[int] = []
    for start in range(0, len(raw) - step + 1, step):
        parent = next_seq_hash(parent, raw[start:start + step], seed)
        out.append(parent)
    return out
