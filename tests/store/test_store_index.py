"""Unit tests of the coordinator's bookkeeping (no processes, no memory)."""

from kvcentric.store.allocator import ExtentAllocator
from kvcentric.store.base import ERR_EXISTS, ERR_HAS_LEASE, ERR_NO_SPACE, ERR_NOT_FOUND, OK
from kvcentric.store.local.index import ObjectIndex

KB = 1024


def put(idx: ObjectIndex, key: str, size: int = 64 * KB, parent: str | None = None,
        owner: int = 1) -> int:
    off = idx.reserve(key, size, parent, owner)
    if off >= 0:
        assert idx.commit(key, owner, None) == OK
    return off


def test_allocator_coalesces() -> None:
    a = ExtentAllocator(1024)
    offs = [a.alloc(100) for _ in range(8)]
    assert None not in offs and a.alloc(100) is None  # 8 * 128 (aligned) = 1024
    for o in offs[::2]:
        a.free(o, 100)  # type: ignore[arg-type]
    assert a.largest_free() == 128 and a.alloc(200) is None
    for o in offs[1::2]:
        a.free(o, 100)  # type: ignore[arg-type]
    assert a.used == 0 and a.largest_free() == 1024 and a.alloc(1000) == 0


def test_pending_is_invisible_and_owned() -> None:
    idx = ObjectIndex(1 << 20)
    assert idx.reserve("a", 10, None, owner=1) >= 0
    assert idx.leading_run(["a"]) == 0 and idx.acquire(["a"], 2) == (0, [])
    assert idx.reserve("a", 10, None, owner=2) == ERR_EXISTS
    assert idx.commit("a", owner=2, checksum=None) == ERR_NOT_FOUND
    assert idx.commit("a", owner=1, checksum=7) == OK
    lease, got = idx.acquire(["a", "b"], 2)
    assert lease and [e.checksum for e in got] == [7]


def test_leading_run() -> None:
    idx = ObjectIndex(1 << 20)
    for k in "abd":
        put(idx, k, 100)
    assert idx.leading_run(["a", "b", "c", "d"]) == 2
    assert idx.leading_run(["c", "a"]) == 0


def test_capacity_bound_and_leaf_first_eviction() -> None:
    idx = ObjectIndex(4 * 64 * KB)
    put(idx, "a0")
    put(idx, "a1", parent="a0")
    put(idx, "a2", parent="a1")
    put(idx, "b0")
    # a0 is the oldest object but has children: the oldest *leaf* is a2
    put(idx, "c0")
    assert set(idx.entries) == {"a0", "a1", "b0", "c0"}
    put(idx, "c1", parent="c0")  # next leaves by age: a1 (now a leaf at the cold end)
    assert "a1" not in idx.entries and "a0" in idx.entries
    assert idx.alloc.used <= idx.alloc.capacity and idx.counters.evictions == 2


def test_lru_touch_on_read() -> None:
    idx = ObjectIndex(3 * 64 * KB)
    for k in "abc":
        put(idx, k)
    lease, _ = idx.acquire(["a"], 1)
    idx.release(lease, 1)
    put(idx, "d")  # evicts b, the least recently used
    assert set(idx.entries) == {"a", "c", "d"}


def test_leased_objects_are_never_evicted_or_freed() -> None:
    idx = ObjectIndex(2 * 64 * KB)
    put(idx, "a")
    put(idx, "b")
    lease, got = idx.acquire(["a", "b"], owner=5)
    assert put(idx, "c") == ERR_NO_SPACE and idx.counters.rejected_puts == 1
    assert idx.remove("a") == ERR_HAS_LEASE
    assert idx.remove("a", force=True) == OK  # gone from the index, memory kept for the reader
    assert idx.alloc.used == 2 * 64 * KB and put(idx, "c") == ERR_NO_SPACE
    idx.release(lease, owner=5)
    assert idx.alloc.used == 64 * KB and put(idx, "c") >= 0


def test_drop_owner_reclaims_leases_and_pending() -> None:
    idx = ObjectIndex(4 * 64 * KB)
    put(idx, "a", owner=1)
    idx.acquire(["a"], owner=9)
    idx.reserve("p", 64 * KB, None, owner=9)
    assert idx.stats()["leases"] == 1 and idx.stats()["pending"] == 1
    assert idx.drop_owner(9) == (1, 1)
    s = idx.stats()
    assert s["leases"] == 0 and s["pending"] == 0 and s["used_bytes"] == 64 * KB
    assert idx.remove("a") == OK and idx.alloc.used == 0


def test_list_keys() -> None:
    idx = ObjectIndex(1 << 20)
    for k in ("a/1", "a/2", "b/1"):
        put(idx, k, 100)
    idx.reserve("a/3", 100, None, owner=1)  # pending: not listed
    assert sorted(idx.list_keys("a/", 10)) == ["a/1", "a/2"]
    assert len(idx.list_keys("", 2)) == 2


def test_key_reuse_after_parent_removed() -> None:
    idx = ObjectIndex(8 * 64 * KB)
    put(idx, "p")
    put(idx, "c", parent="p")
    idx.remove("p", force=True)
    put(idx, "p")  # a new object under the old key
    idx.remove("c")
    assert idx.entries["p"].children == 0
    assert idx.clear() == 1 and idx.alloc.used == 0
