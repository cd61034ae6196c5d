"""Stored objects of the SGLang backend: one object per host-pool page, and its keys.

SGLang's host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) describes where a
page lives with ``get_page_buffer_meta(indices) -> (ptrs, sizes)``: ``S`` segments per
page, in pool order, e.g.

- MHA ``page_first`` / ``page_first_direct`` / ``page_head``: ``[K, V]`` (S = 2), each
  ``layers * page_size * heads * head_dim`` elements;
- MHA ``layer_first``: ``[K_0, V_0, K_1, V_1, ...]`` (S = 2 * layers);
- MLA ``page_first``: one latent segment (S = 1); MLA ``layer_first``: one per layer.

A stored object is one page, all layers, K and V, for one rank: the integrity header
region (:data:`~kvcentric.integrity.HEADER_BYTES`, :mod:`kvcentric.integrity`), then the
segments concatenated, MHA keys first (every K segment, then every V segment). That
payload is also the byte order of ``get_data_page(index, flat=True)``, so objects written
through the zero-copy v1 interface and through the legacy tensor interface are the same
bytes under the same key.

The header names the page the object was written for: :meth:`PageGeometry.refs` makes its
:class:`~kvcentric.integrity.ObjectRef` from the SGLang key alone (digest: the page hash,
or xxh3_128 of it when it is not 16 bytes; index 0, since SGLang's page hash is chained
over the prefix and so already fixes the position, and the legacy interface knows no
index; count: the page's tokens), so writer and reader, either interface, agree. With the
key space (model, layout signature, rank) and the payload size in the header, a page is
never loaded into another page, rank, layout or format.

Keys come from :class:`kvcentric.hashing.KeySpace`. SGLang hands us its page hashes
(hex strings, chained over the prefix); the key folds in the model, a
:class:`~kvcentric.stored_layout.KVLayout` signature of the pool (``sglang:{layout}``, layers,
page size, heads, head size, dtype, MLA) and the rank. MLA KV is the same on every TP
rank, so MLA keys use rank ``0of1`` (``dcp_rank of dcp_size`` under decode context
parallelism) and only the storage writer (TP rank 0) stores them; every rank reads. Their
header carries that same ``0of1`` rank, the one every TP rank expects.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import xxhash

from kvcentric.hashing import KeySpace
from kvcentric.integrity import HEADER_BYTES, ObjectHeaders, ObjectRef
from kvcentric.stored_layout import KVLayout, dtype_name

_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


def page_hash(sglang_key: str) -> bytes:
    """Digest bytes of one SGLang page key: the hex hash itself, or xxh3_128 of any
    other string (key schemes that append suffixes)."""
    if _HEX.fullmatch(sglang_key):
        return bytes.fromhex(sglang_key)
    return xxhash.xxh3_128_digest(sglang_key.encode())


def header_digest(page: bytes) -> bytes:
    """The 16-byte chain digest the integrity header stores for page hash ``page``: the
    hash itself when it has 16 bytes, else xxh3_128 of it (SGLang's SHA-256 hashes; the
    header would otherwise cut a longer hash and zero-pad a shorter one)."""
    return page if len(page) == 16 else xxhash.xxh3_128_digest(page)


@dataclass(frozen=True)
class PageGeometry:
    """How the pages of one registered host pool map to store objects.

    ``seg_sizes[j]`` is the size of segment ``j`` (pool order) and ``offsets[j]`` where
    it sits in the object (past the header region). ``index_stride`` is how many host
    indices SGLang passes per page (the logical page size), and the token count in the
    header. ``headers`` writes and checks the headers of this key space's pages.
    """

    layout: KVLayout
    keyspace: KeySpace
    index_stride: int
    seg_sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    writer: bool
    headers: ObjectHeaders = field(compare=False, repr=False)

    @property
    def segments(self) -> int:
        return len(self.seg_sizes)

    @property
    def payload_bytes(self) -> int:
        """One page's bytes (what ``get_data_page(flat=True)`` holds)."""
        return sum(self.seg_sizes)

    @property
    def object_bytes(self) -> int:
        """One stored object: header region plus page."""
        return HEADER_BYTES + self.payload_bytes

    def keys(self, sglang_keys: Sequence[str]) -> list[str]:
        return self.keyspace.keys([page_hash(k) for k in sglang_keys])

    def refs(self, sglang_keys: Sequence[str]) -> list[ObjectRef]:
        """What each page's object is written for, as its header says (module docstring)."""
        return self.objects(sglang_keys)[1]

    def objects(self, sglang_keys: Sequence[str]) -> tuple[list[str], list[ObjectRef]]:
        """:meth:`keys` and :meth:`refs` of ``sglang_keys``, each page hash parsed once."""
        hashes = [page_hash(k) for k in sglang_keys]
        return self.keyspace.keys(hashes), [ObjectRef(header_digest(h), 0, self.index_stride)
                                            for h in hashes]

    def headers_for(self, payload_bytes: int) -> ObjectHeaders:
        """Headers of objects of ``payload_bytes`` (the legacy interface takes any size;
        a page's is :attr:`headers`)."""
        if payload_bytes == self.payload_bytes:
            return self.headers
        return ObjectHeaders(self.keyspace, payload_bytes)

    def parents(self, keys: Sequence[str], prefix_keys: Sequence[str] | None) -> list[str | None]:
        """Chain predecessor of each key, so the store evicts leaves first."""
        first = self.keyspace.key(page_hash(prefix_keys[-1])) if prefix_keys else None
        return [first, *keys[:-1]] if keys else []

    def page_ptrs(self, pool: Any, host_indices: torch.Tensor, pages: int) -> list[int]:
        """Segment pointers of ``pages`` pages (``pages * segments`` of them), checked
        against the registered geometry."""
        if host_indices.numel() != pages * self.index_stride:
            raise ValueError(f"{host_indices.numel()} host indices for {pages} pages of "
                             f"{self.index_stride}")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * self.segments or any(
                s != self.seg_sizes[i % self.segments] for i, s in enumerate(sizes)):
            raise ValueError("host pool page layout changed since registration")
        return [int(p) for p in ptrs]

    def gather(self, seg_ptrs: Sequence[int], dst: int) -> None:
        """Copy one page's segments into the object at ``dst`` (its header is apart)."""
        for ptr, off, size in zip(seg_ptrs, self.offsets, self.seg_sizes):
            ctypes.memmove(dst + off, ptr, size)

    def scatter(self, src: int, seg_ptrs: Sequence[int]) -> None:
        """Copy the object at ``src`` into one page's segments."""
        for ptr, off, size in zip(seg_ptrs, self.offsets, self.seg_sizes):
            ctypes.memmove(ptr, src + off, size)


def _layout_name(pool: Any, cfg: Any) -> str:
    name = f"sglang:{pool.layout}"
    if int(getattr(cfg, "pp_size", 1)) > 1:
        name += f":pp{cfg.pp_rank}of{cfg.pp_size}"
    if int(getattr(cfg, "attn_cp_size", 1)) > 1:
        name += f":cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    return name


def _is_writer(cfg: Any) -> bool:
    writer = getattr(cfg, "is_storage_writer", None)  # SGLang >= 0.5.2x
    if writer is None:
        return not cfg.is_mla_model or int(cfg.tp_rank) == 0
    return bool(writer)


def page_geometry(pool: Any, cfg: Any, model_id: str) -> PageGeometry:
    """Geometry and keys of ``pool`` (an SGLang host KV pool) under ``cfg`` (SGLang's
    ``HiCacheStorageConfig``). Raises ``ValueError`` for a pool it cannot serve."""
    if getattr(pool, "kv_buffer", None) is None:
        raise ValueError("host pool has no KV buffer (logical-only pools are not supported)")
    stride = int(getattr(pool, "logical_page_size", pool.page_size))
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(stride, dtype=torch.int64))
    if not ptrs or any(int(s) <= 0 for s in sizes):
        raise ValueError("host pool reports no page segments")
    sizes = [int(s) for s in sizes]
    mla = bool(cfg.is_mla_model)
    n = len(sizes)
    # MHA segments alternate K and V; K first makes the object the flat data page.
    order = list(range(n)) if mla or n % 2 else [*range(0, n, 2), *range(1, n, 2)]
    offsets = [0] * n
    off = 0
    for j in order:
        offsets[j] = HEADER_BYTES + off
        off += sizes[j]
    heads, head_dim = (1, int(pool.kv_cache_dim)) if mla else (int(pool.head_num),
                                                              int(pool.head_dim))
    name = _layout_name(pool, cfg)
    layout = KVLayout(num_layers=int(pool.layer_num), block_size=int(pool.page_size),
                      num_kv_heads=heads, head_dim=head_dim, dtype=dtype_name(pool.dtype),
                      layout=name, mla=mla)
    if layout.bytes_per_block != off:  # e.g. a different V width: keep such pages apart
        layout = replace(layout, layout=f"{name}:b{off}")
    if mla:
        rank, size = int(getattr(cfg, "dcp_rank", 0)), int(getattr(cfg, "dcp_size", 1))
    else:
        rank, size = int(cfg.tp_rank), int(cfg.tp_size)
    keyspace = KeySpace(model_id, layout.signature(), rank, size)
    return PageGeometry(layout, keyspace, stride, tuple(sizes), tuple(offsets),
                        _is_writer(cfg), ObjectHeaders(keyspace, off))
