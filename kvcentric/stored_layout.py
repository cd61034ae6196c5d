"""KV block layout: what decides the bytes of one stored block, and its short signature.

A stored object is one full block of ``block_size`` tokens, all layers, K and V, for one TP
rank. Its bytes depend on the number of layers, the block size, the number of KV heads,
the head size, the dtype, how the engine lays a block out in memory, and whether K and V
are split (MHA) or fused into one latent (MLA). All of that goes into :meth:`signature`,
which is part of every key, so two engines share KV only when the bytes mean the same.
A hybrid model's KV cache groups (which layers are full attention, sliding window of
which size, or recurrent state) are part of it too (``groups``).
So does the model's ``revision`` (:mod:`kvcentric.model_revision`): new weights served
under an old name never load the old weights' KV.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import xxhash

# ``layout`` names how the engine lays out one page in memory, e.g. ``cpu:LBHNC:amx``
# (vLLM CPU, ISA-prepacked), ``cuda:LBNHC`` (FlashAttention), ``sglang:page_first``.
_LAYOUT_RE = re.compile(r"[A-Za-z0-9_:.+-]{1,64}")


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one stored block object.

    ``block_size`` is tokens per *stored* block (a multiple of the engine page size).
    ``bytes_per_layer`` is the size of one layer's slice of one stored block.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str
    mla: bool = False
    revision: str = ""  # the model's revision digest ("" = not known)
    groups: str = ""  # a hybrid model's KV cache groups (connector/vllm/groups.py), "" = one

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not _LAYOUT_RE.fullmatch(self.layout):
            raise ValueError(f"layout name {self.layout!r} must be 1 to 64 letters, digits, "
                             "'_', ':', '.', '+' or '-'")
        if _itemsize(self.dtype) <= 0:
            raise ValueError(f"unsupported dtype {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def bytes_per_layer(self) -> int:
        kv = 1 if self.mla else 2
        return kv * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_layer

    def signature(self) -> str:
        """16 hex chars of xxh3_64 over the canonical JSON of every field (an unknown
        revision and the groups of a single-group model are left out, so such signatures
        stay what they were before revisions and groups)."""
        fields = asdict(self)
        for name in ("revision", "groups"):
            if not fields[name]:
                del fields[name]
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_hexdigest(canon.encode())


# The one dtype-size table (connector, SGLang backend and router all size KV through it).
_ITEMSIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "uint8": 1, "int8": 1,
}
# Spellings found in model configs and vLLM's --kv-cache-dtype
_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
            "half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "fp32": "float32"}


def _itemsize(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    return _ITEMSIZES.get(_ALIASES.get(name, name), 0)


def dtype_name(dtype: object) -> str:
    """Canonical name of a torch/numpy dtype or an alias (``torch.bfloat16``, ``"bf16"``
    -> ``"bfloat16"``); ``ValueError`` for a dtype KV is never stored in."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if _itemsize(name) <= 0:
        raise ValueError(f"unsupported KV dtype {dtype!r}")
    return name


def dtype_itemsize(dtype: object) -> int:
    """Bytes per element of ``dtype`` (see :func:`dtype_name`)."""
    return _ITEMSIZES[dtype_name(dtype)]


def stored_block_size(page_size: int, configured: int | None = None) -> int:
    """Tokens per stored object, the one rule connector and router share.

    ``configured`` (the connector's ``block_size``) must be a multiple of the engine's
    ``page_size``; ``None`` picks the page when it holds >= 128 tokens (vLLM CPU), else the
    smallest page multiple >= 256 (GPU pages of 16). A hit recomputes at most the partial
    last stored block, so a block coarser than the page costs TTFT.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if configured is None:
        return page_size if page_size >= 128 else page_size * -(-256 // page_size)
    if configured <= 0 or configured % page_size:
        raise ValueError(f"block_size {configured} must be a positive multiple of the "
                         f"engine's page size {page_size}")
    return configured
