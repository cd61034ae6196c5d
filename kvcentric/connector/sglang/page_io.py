"""Move SGLang host-pool pages to and from store objects (one object per page).

Memory: ``ptrs`` point into SGLang's host pool (its memory, registered with the store);
a page is ``geo.segments`` consecutive entries of ``ptrs``. Slot and lease pointers
belong to the store and are used only between alloc and commit, acquire and release.

Every object is ``[integrity header][page]`` (:mod:`kvcentric.integrity`; what the header
names: :meth:`~kvcentric.connector.sglang.pages.PageGeometry.refs`), so no page moves
straight between pool memory and the store any more:

- Saves write in-place slots (``batch_alloc`` / ``batch_commit``; invisible until
  committed, so never torn): the header, then the page, one memcpy per segment.
- Loads lease the objects (``batch_acquire``; never evicted while held) and check every
  leased object's size, header and (``verify``) checksum *before a byte reaches the
  host pool*; then the page is copied out, one memcpy per segment. An object whose size
  or header is not the one asked for is a miss, reported in :attr:`Loaded.mismatched`.
  A lease that lapsed while copying makes its pages misses (bytes may be torn).

A one-segment page (MLA ``page_first``) costs what it did on the local store (its
``batch_put_from`` / ``batch_get_into`` are the same slot and lease with one memcpy);
on Mooncake a load now lands in staging and is copied from there (one memcpy more than
a get straight into the pool: the header is checked before the pool sees a byte).

These functions may raise store exceptions; the backend turns them into misses.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcentric.connector.sglang.pages import PageGeometry
from kvcentric.integrity import HEADER, HEADER_BYTES, ObjectHeaders, ObjectRef, describe
from kvcentric.store import OK, KVStore

Target = tuple[int, int, torch.Tensor | None]  # (ptr, nbytes, tensor or None)


@dataclass
class Loaded:
    """Result of a load: ``ok`` per key; ``mismatched``, one line per object stored under
    a key it was not written for (header, or size, not the expected one)."""

    ok: list[bool]
    mismatched: list[str] = field(default_factory=list)


def load_pages(store: KVStore, geo: PageGeometry, keys: list[str], refs: list[ObjectRef],
               ptrs: list[int], verify: bool) -> Loaded:
    """Copy stored objects ``keys`` (written for ``refs``) into their pages; ``True`` per
    page loaded. Loads the leading run of present, well-formed objects: stops at the
    first missing, wrong-sized, mismatched or (``verify``) corrupt one."""
    seg, size = geo.segments, geo.object_bytes
    return _load(store, keys, [size] * len(keys), [geo.headers] * len(keys), refs, verify,
                 lambda i, src: geo.scatter(src, ptrs[i * seg:(i + 1) * seg]), leading=True)


def load_objects(store: KVStore, geo: PageGeometry, keys: list[str], refs: list[ObjectRef],
                 targets: Sequence[Target], verify: bool) -> Loaded:
    """The legacy interface's loads: each object's payload into its target (``nbytes`` at
    ``ptr``); each key on its own (a miss does not end the batch)."""
    sizes = [HEADER_BYTES + t[1] for t in targets]
    heads = [geo.headers_for(t[1]) for t in targets]

    def copy(i: int, src: int) -> None:
        ctypes.memmove(targets[i][0], src + HEADER_BYTES, targets[i][1])

    return _load(store, keys, sizes, heads, refs, verify, copy, leading=False)


def _load(store: KVStore, keys: list[str], sizes: list[int], heads: list[ObjectHeaders],
          refs: list[ObjectRef], verify: bool, copy: Callable[[int, int], None],
          leading: bool) -> Loaded:
    """Lease ``keys``, check each leased object, then ``copy(i, object ptr)`` the good
    ones: the leading run (``leading``) or every one (leasing again past each gap)."""
    out = Loaded([False] * len(keys))
    start = 0
    while start < len(keys):
        lease = store.batch_acquire(keys[start:], sizes[start:])
        try:
            good: list[int] = []
            for j, (src, got) in enumerate(zip(lease.ptrs, lease.sizes)):
                i = start + j
                bad = _mismatch(heads[i], src, got, sizes[i], refs[i])
                if bad is not None:
                    out.mismatched.append(f"{keys[i]}: {bad}")
                elif not verify or lease.verified(j):
                    if not leading or len(good) == j:
                        good.append(j)
            for j in good:
                copy(start + j, lease.ptrs[j])
            if store.lease_valid(lease):  # else: the lease lapsed while copying
                for j in good:
                    out.ok[start + j] = True
        finally:
            store.release(lease)
        if leading:
            break
        start += len(lease.keys) + 1  # past the leased run and the key that ended it
    return out


def _mismatch(heads: ObjectHeaders, ptr: int, got: int, want: int,
              ref: ObjectRef) -> str | None:
    """Why the object at ``ptr`` (``got`` bytes) is not the one written for ``ref``, or
    ``None`` when it is."""
    if got == want and heads.check(ptr, ref):
        return None
    claims = (heads.describe(ptr) if got >= HEADER.size else "no header")
    return (f"{got} B, written for {claims}; expected {want} B, "
            f"{describe(heads.expected(ref))}")


def save_pages(store: KVStore, geo: PageGeometry, keys: list[str], refs: list[ObjectRef],
               ptrs: list[int], parents: list[str | None]) -> list[bool]:
    """Store each page under its key, its header naming ``refs[i]``; ``True`` per page
    stored or already present."""
    seg = geo.segments

    def fill(i: int, dst: int) -> None:
        geo.headers.write(dst, refs[i])
        geo.gather(ptrs[i * seg:(i + 1) * seg], dst)

    return _save(store, keys, [geo.object_bytes] * len(keys), parents, fill)


def save_objects(store: KVStore, geo: PageGeometry, keys: list[str], refs: list[ObjectRef],
                 sources: Sequence[Target], parents: list[str | None]) -> list[bool]:
    """The legacy interface's saves: each source's ``nbytes`` at ``ptr`` as an object's
    payload, behind its header."""
    def fill(i: int, dst: int) -> None:
        ptr, nbytes, _ = sources[i]
        geo.headers_for(nbytes).write(dst, refs[i])
        ctypes.memmove(dst + HEADER_BYTES, ptr, nbytes)

    return _save(store, keys, [HEADER_BYTES + t[1] for t in sources], parents, fill)


def _save(store: KVStore, keys: list[str], sizes: list[int], parents: list[str | None],
          fill: Callable[[int, int], None]) -> list[bool]:
    slots = store.batch_alloc(keys, sizes, parents)
    live = [s for s in slots if s is not None]
    try:
        for i, slot in enumerate(slots):
            if slot is not None:
                fill(i, slot.ptr)
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
