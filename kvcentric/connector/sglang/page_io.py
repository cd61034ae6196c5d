"""Move SGLang host-pool pages to and from store objects (one object per page).

Memory: ``ptrs`` point into SGLang's host pool (its memory, registered with the store);
a page is ``geo.segments`` consecutive entries of ``ptrs``. Slot and lease pointers
belong to the store and are used only between alloc and commit, acquire and release.

- One segment per page (MLA ``page_first``): the page *is* the object; one
  ``batch_put_from`` / ``batch_get_into`` per batch, straight on pool memory.
- Several segments: written into in-place slots (``batch_alloc`` / ``batch_commit``;
  invisible until committed, so never torn) and read out of leases (``batch_acquire``;
  never evicted while held). One memcpy per segment, like the direct path.

These functions may raise store exceptions; the backend turns them into misses.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcentric.connector.sglang.pages import PageGeometry
from kvcentric.store import OK, KVStore

Target = tuple[int, int, torch.Tensor | None]  # (ptr, nbytes, tensor or None)


def load_pages(store: KVStore, geo: PageGeometry, keys: list[str], ptrs: list[int],
               verify: bool) -> list[bool]:
    """Copy stored objects ``keys`` into their pages; ``True`` per page loaded. Stops at
    the first missing, wrong-sized or (``verify``) corrupt object."""
    n, seg, size = len(keys), geo.segments, geo.object_bytes
    if seg == 1:  # the store checks checksums itself on this path
        got = store.batch_get_into(keys, ptrs, [size] * n)
        return [g == size for g in got]
    ok = [False] * n
    lease = store.batch_acquire(keys, [size] * n)
    try:
        for i, (src, got_size) in enumerate(zip(lease.ptrs, lease.sizes)):
            if got_size != size or (verify and not lease.verified(i)):
                break
            geo.scatter(src, ptrs[i * seg:(i + 1) * seg])
            ok[i] = True
        if not store.lease_valid(lease):
            return [False] * n  # the lease lapsed while copying: bytes may be torn
    finally:
        store.release(lease)
    return ok


def save_pages(store: KVStore, geo: PageGeometry, keys: list[str], ptrs: list[int],
               parents: list[str | None]) -> list[bool]:
    """Store each page under its key; ``True`` per page stored or already present."""
    n, seg, size = len(keys), geo.segments, geo.object_bytes
    if seg == 1:
        return [c == OK for c in store.batch_put_from(keys, ptrs, [size] * n, parents)]
    slots = store.batch_alloc(keys, [size] * n, parents)
    live = [s for s in slots if s is not None]
    try:
        for i, slot in enumerate(slots):
            if slot is not None:
                geo.gather(ptrs[i * seg:(i + 1) * seg], slot.ptr)
    except BaseException:
        store.batch_abort(live)
        raise
    committed = dict(zip([s.key for s in live], store.batch_commit(live)))
    # no slot: the key is stored already, or there was no space for it
    have = present(store, [k for k, s in zip(keys, slots) if s is None])
    return [committed[k] == OK if s is not None else have[k] for k, s in zip(keys, slots)]


def present(store: KVStore, keys: list[str]) -> dict[str, bool]:
    """Which ``keys`` are stored, with leading-run lookups (all present: one call)."""
    out: dict[str, bool] = {}
    i = 0
    while i < len(keys):
        n = store.batch_exists(keys[i:])
        out.update(dict.fromkeys(keys[i:i + n], True))
        i += n
        if i < len(keys):
            out[keys[i]] = False
            i += 1
    return out


def legacy_target(loc: Any, size: Any, writable: bool) -> Target | None:
    """(ptr, nbytes, tensor) of a legacy-interface target: a CPU tensor, or an int
    pointer with an int size (Mooncake's convention); ``None`` if unusable."""
    if isinstance(loc, torch.Tensor):
        if loc.device.type != "cpu":
            return None
        if not loc.is_contiguous():
            if writable:
                return None  # a copy would not land in the caller's memory
            loc = loc.contiguous()
        return loc.data_ptr(), loc.numel() * loc.element_size(), loc
    if isinstance(loc, int) and not isinstance(loc, bool) and isinstance(size, int) and size > 0:
        return loc, size, None
    return None
