"""Connector stats: summing across workers, rates, take-and-reset."""

from kvcentric.connector.vllm.counters import Counters
from kvcentric.connector.vllm.stats import FIELDS, KVCentricStats


def test_aggregate_reduce_take() -> None:
    a, b = Counters(), KVCentricStats()
    assert KVCentricStats.from_counters(a) is None
    a.add(loaded_bytes=3e9, load_seconds=1.5, loaded_blocks=3)
    b.add(loaded_bytes=1e9, load_seconds=0.5, saved_bytes=2e9, save_seconds=1.0, load_errors=1)
    total = KVCentricStats(data=dict(a.data)).aggregate(b)
    red = total.reduce()
    assert red["loaded_bytes"] == 4e9 and red["load_gbps"] == 2.0 and red["save_gbps"] == 2.0
    assert red["load_errors"] == 1 and set(FIELDS) <= set(red)
    snap = KVCentricStats.from_counters(a)
    assert snap is not None and snap.data["loaded_blocks"] == 3 and a.take() is None
    rebuilt = KVCentricStats(data=snap.to_dict())  # the payload survives a round trip
    assert rebuilt.data == snap.data
