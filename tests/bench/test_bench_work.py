"""benchmarks/serving/work.py: each connector arm's saves and loads read from its own
accounting (ours, LMCache's server, the Mooncake master), and what makes an arm invalid."""

from __future__ import annotations

from benchmarks.serving import work

LMCACHE_PAGE = """# HELP lmcache_mp_l1_write_chunks_total Total chunks written to L1
# TYPE lmcache_mp_l1_write_chunks_total counter
lmcache_mp_l1_write_chunks_total{cache_salt="",l1_tag="x"} 3.0
lmcache_mp_l1_write_chunks_total{cache_salt="s",l1_tag="x"} 2.0
lmcache_mp_l1_write_chunks_created{cache_salt=""} 1.7e9
lmcache_mp_l1_read_chunks_total{cache_salt=""} 4.0
lmcache_mp_num_chunks_loaded_total{worker_id="0"} 0.0
lmcache_mp_l1_usage_ratio 0.25
"""


def test_lmcache_counts_come_from_its_server_page() -> None:
    m = work.prometheus_sums(LMCACHE_PAGE)
    assert m["lmcache_mp_l1_write_chunks_total"] == 5.0
    w = work.lmcache(m, chunk_tokens=256)
    assert (w.saved, w.loaded, w.unit) == (5 * 256, 4 * 256, "tokens")
    assert work.lmcache({}, 256).saved == 0  # a server that counted nothing yet


def test_ours_and_mooncake() -> None:
    ours = work.ours({work.OURS[0]: 3.0, work.OURS[1]: 2.0}, block_tokens=128)
    assert (ours.saved, ours.loaded) == (384, 256)
    mc = work.mooncake({"master_batch_put_end_items_total": 7.0,
                        "master_put_end_requests_total": 1.0},
                       {work.EXTERNAL_HITS: 1024.0})
    assert (mc.saved, mc.loaded) == (8.0, 1024.0)


def test_an_arm_is_invalid_unless_it_did_what_it_is_timed_for() -> None:
    before = work.Work(100, 50, "tokens", "its server")
    assert work.invalid(work.Work(300, 80, "tokens", "its server") - before, True, True) is None
    assert work.invalid(work.Work(100, 80, "tokens", "its server") - before, True, True) \
        == "saved nothing by its server"
    assert work.invalid(work.Work(100, 50, "tokens", "its server") - before, True, True) \
        == "saved and loaded nothing by its server"
    assert work.invalid(work.Work(300, 50, "tokens", "its server") - before, True, False) is None
