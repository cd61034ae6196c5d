"""The ``KVStore`` interface every backend implements (docs/store.md §Contract).

Contract, common to all backends:

- Keys are strings from :class:`kvcentric.hashing.KeySpace`; values are opaque byte ranges.
- ``batch_exists(keys)`` returns the length of the *leading run* of present keys (prefix
  semantics): keys after the first missing one are not counted. It is a hint: ``keys``
  are a chain (each key's ``parent`` at put time is the key before it), and the local
  store's shared-memory lookups may overcount a list that is not one; reads are exact.
- ``batch_residency(keys)`` is ``batch_exists`` plus where the run lives: which of its
  objects only a slower tier (the local store's disk) holds, so a router can predict the
  load time per tier. One round trip at most; a hint, like ``batch_exists``.
- ``batch_put_from(keys, ptrs, sizes)`` copies each ``sizes[i]`` bytes at address ``ptrs[i]``
  into the store and returns one code per key: ``0`` stored (or already present), negative
  on failure (``ERR_NO_SPACE`` when the capacity bound cannot be met).
- ``batch_get_into(keys, ptrs, sizes)`` copies each object into caller memory and returns one
  value per key: the bytes read, or a negative error (``ERR_NOT_FOUND``, ``ERR_CORRUPT``...).
- A block being written is invisible until committed; a block being read is never evicted or
  overwritten under its reader; a reader never sees a torn block.
- Memory behind ``ptrs`` is owned by the caller and must stay valid for the call; backends
  that need registered memory (RDMA) require :meth:`register_buffer` first.
- No call blocks longer than the configured op timeout; an unreachable store fails calls
  with ``ERR_UNAVAILABLE`` so engines recompute.

Optional zero-copy paths with working defaults:

- :meth:`batch_alloc` / :meth:`batch_commit` / :meth:`batch_abort`: write an object in place
  (local store: straight into shared memory), visible only after commit.
- :meth:`batch_acquire`: read objects in place under a lease until released.
- :meth:`batch_acquire_streamed` + :meth:`fetch_range`: lease now, receive the bytes range by
  range (e.g. one layer at a time, under compute); by default the whole lease is eager.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

OK = 0
ERR_NO_SPACE = -200
ERR_INVALID = -600
ERR_NOT_FOUND = -704
ERR_EXISTS = -705
ERR_HAS_LEASE = -706
ERR_TRANSFER = -800
ERR_CORRUPT = -900
ERR_UNAVAILABLE = -1000

ERROR_NAMES = {
    ERR_NO_SPACE: "no space", ERR_INVALID: "invalid argument", ERR_NOT_FOUND: "not found",
    ERR_EXISTS: "exists", ERR_HAS_LEASE: "has lease", ERR_TRANSFER: "transfer failed",
    ERR_CORRUPT: "checksum mismatch", ERR_UNAVAILABLE: "store unavailable",
}


class StoreUnavailable(RuntimeError):
    """The store cannot be reached or did not answer in time."""


@dataclass
class WriteSlot:
    """Memory for one object being written in place; invisible until committed.

    ``ptr`` points at ``size`` writable bytes owned by the store until commit/abort.
    """

    key: str
    ptr: int
    size: int
    handle: Any = None


@dataclass
class ReadLease:
    """In-place read access to the leading ``len(ptrs)`` of the requested keys.

    The bytes at ``ptrs[i]`` stay valid and unchanged until :meth:`KVStore.release`.
    ``checksums`` holds the object checksums when the store verifies them, else ``None``s.
    """

    keys: list[str]
    ptrs: list[int]
    sizes: list[int]
    checksums: list[int | None] = field(default_factory=list)
    handle: Any = None

    def verified(self, i: int, ptr: int | None = None) -> bool:
        """True when object ``i``'s bytes (at ``ptr``, default ``ptrs[i]``: pass the
        destination after copying out) match its checksum; False without a checksum."""
        want = self.checksums[i] if i < len(self.checksums) else None
        return want is not None and checksum(self.ptrs[i] if ptr is None else ptr,
                                             self.sizes[i]) == want


@dataclass(frozen=True)
class Residency:
    """Where the leading run of a key chain lives (:meth:`KVStore.batch_residency`).

    ``run``: the leading run of present keys over every tier, as ``batch_exists`` counts
    it. ``disk_only``: the positions (ascending, each ``< run``) of the objects of that run
    resident only on a slower tier (the local store's disk), i.e. not in DRAM; an object in
    both tiers counts as DRAM. Empty for stores without such a tier.
    """

    run: int
    disk_only: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.run < 0 or len(self.disk_only) > self.run or (
                self.disk_only and not 0 <= self.disk_only[0] <= self.disk_only[-1] < self.run):
            raise ValueError(f"bad residency: run {self.run}, disk-only {self.disk_only[:8]}")

    @property
    def on_disk(self) -> int:
        """How many objects of the run are resident only on disk."""
        return len(self.disk_only)


def checksum(ptr: int, size: int) -> int:
    """The object checksum every backend and connector uses: xxh3_64 of ``size`` bytes at
    ``ptr`` (read in place, no copy)."""
    return xxhash.xxh3_64_intdigest((ctypes.c_char * size).from_address(ptr))


class KVStore(ABC):
    """Abstract KV block store. See the module docstring for the contract."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int: ...

    @abstractmethod
    def batch_put_from(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        parents: Sequence[str | None] | None = None,
    ) -> list[int]:
        """Store objects; ``parents[i]`` names the chain predecessor of ``keys[i]`` so the
        store can evict leaves first (``None``: a root or unknown)."""

    @abstractmethod
    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]: ...

    @abstractmethod
    def remove(self, key: str, force: bool = False) -> int: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def list_keys(self, prefix: str = "", limit: int = 1000) -> list[str]:
        """Up to ``limit`` committed keys starting with ``prefix`` (administration and
        layout discovery; not on a hot path)."""

    def batch_residency(self, keys: Sequence[str]) -> Residency:
        """The leading run of ``keys`` (exactly what :meth:`batch_exists` would answer) and
        which of its objects are resident only on disk (:class:`Residency`).

        Same hint semantics as ``batch_exists`` (``keys`` a chain; the answer may be stale
        by the time it is used). At most one round trip to the store. Default (stores
        without a slower tier, e.g. Mooncake here): ``Residency(batch_exists(keys))``,
        nothing on disk."""
        return Residency(self.batch_exists(keys) if keys else 0)

    def residency_nowait(self, keys: Sequence[str]) -> Residency | None:
        """:meth:`batch_residency`'s answer when this client can give it from memory it
        maps, with no call to another process (so without blocking: an event loop may
        call it), else None: the caller then asks :meth:`batch_residency`, off its loop.
        Never raises. Default: None (every answer is a call)."""
        return None

    def lease_valid(self, lease: ReadLease) -> bool:
        """False when ``lease`` lapsed (e.g. the store reclaimed it after a dropped
        connection): bytes read through it may be torn. Default: leases never lapse."""
        return True

    def warm_up(self) -> None:
        """Allocate and fault in what this client's data path uses (Mooncake: its staging
        arena) before serving, so no request pays for it; best effort, never raises.
        Default: nothing to do (the local store maps its arena when it opens)."""
        return None

    def pin_host_memory(self, pinner: HostPinner) -> None:  # noqa: B027 (a no-op default)
        """Register the host memory this client hands out in write slots and read leases
        with the GPU through ``pinner``: now, and again for every later mapping (a
        reconnect), always unregistering a mapping before unmapping it. Called once by a
        CUDA worker before serving; copies between HBM and pinned memory run as DMA at
        PCIe speed and the Triton kernels can address it. Default: nothing to pin (this
        backend's slots and leases are private buffers made per call)."""

    def register_buffer(self, ptr: int, size: int) -> int:
        """Register caller memory used with put/get; a no-op where not needed."""
        return OK

    def unregister_buffer(self, ptr: int) -> int:
        return OK

    def health_check(self) -> bool:
        """True when the store answers; cheap, called by degrade paths."""
        try:
            self.stats()
            return True
        except StoreUnavailable:
            return False

    # ---- zero-copy write, default: private staging memory + batch_put_from at commit ----
    def batch_alloc(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        parents: Sequence[str | None] | None = None,
    ) -> list[WriteSlot | None]:
        """Reserve write slots; ``None`` for keys already stored (nothing to write)."""
        present = self.batch_exists(keys) if keys else 0
        out: list[WriteSlot | None] = [None] * present
        for i in range(present, len(keys)):
            buf = ctypes.create_string_buffer(sizes[i])
            parent = parents[i] if parents else None
            out.append(WriteSlot(keys[i], ctypes.addressof(buf), sizes[i], (buf, parent)))
        return out

    def batch_commit(self, slots: Sequence[WriteSlot], pin_s: float = 0.0) -> list[int]:
        """Make written slots visible; returns one code per slot. ``pin_s`` > 0 soft-pins
        the objects for a P/D handoff: not evicted for up to ``pin_s`` seconds or until
        first read (local store; Mooncake: its soft pin, released at the TTL). Default:
        no pins (the copy below is a plain put)."""
        if not slots:
            return []
        return self.batch_put_from(
            [s.key for s in slots], [s.ptr for s in slots], [s.size for s in slots],
            [s.handle[1] for s in slots],
        )

    def batch_abort(self, slots: Sequence[WriteSlot]) -> None:  # noqa: B027 (a no-op default)
        """Drop slots without publishing them (staging memory is simply freed)."""

    # ---- zero-copy read, default: copy into private memory ----
    def batch_acquire(self, keys: Sequence[str], sizes: Sequence[int] | None = None) -> ReadLease:
        """Lease the leading run of present ``keys`` for in-place reads.

        ``sizes`` bounds each object; backends that copy (this default) need it."""
        if sizes is None:
            raise ValueError("this backend needs the object sizes to lease objects")
        bufs = [ctypes.create_string_buffer(s) for s in sizes]
        got = self.batch_get_into(keys, [ctypes.addressof(b) for b in bufs], sizes)
        n = next((i for i, g in enumerate(got) if g != sizes[i]), len(got))
        return ReadLease(list(keys[:n]), [ctypes.addressof(b) for b in bufs[:n]],
                         list(sizes[:n]), [None] * n, bufs)

    def batch_acquire_streamed(self, keys: Sequence[str], sizes: Sequence[int]) -> ReadLease:
        """Lease the leading run of present ``keys`` like :meth:`batch_acquire`, except that
        the bytes may arrive later: a byte range of the leased objects is readable only once
        :meth:`fetch_range` has returned for it. ``sizes`` are the exact object sizes.
        Default: an eager lease (every byte present at return)."""
        return self.batch_acquire(keys, sizes)

    def fetch_range(self, lease: ReadLease, offset: int, size: int) -> None:  # noqa: B027
        """Bring bytes ``[offset, offset + size)`` of every object of a streamed lease to
        its pointer; a no-op for eager leases (this default). May run on another thread
        than the one that acquired (one call per lease at a time, before :meth:`release`).
        Raises ``StoreUnavailable`` when the range cannot be read: those bytes are then
        undefined and the caller must not use them."""

    def release(self, lease: ReadLease) -> None:
        """End a read lease; its pointers become invalid."""
        lease.handle = None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
