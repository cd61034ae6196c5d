"""Hybrid and MLA models end to end on vLLM CPU servers and a real local store: a reader
that loads what another instance stored answers exactly a plain engine's tokens.

- ``gemma3-sliding`` (full + 256-token sliding-window groups) and ``lfm2`` (short-conv
  recurrent state + attention): vLLM keeps its hybrid KV cache manager on with our
  connector (``SupportsHMA``: no "Turning off hybrid kv cache manager" warning), every
  group stores and loads what a hit needs, loads are asynchronous.
- ``nemotron-h`` (Mamba2): vLLM CPU runs it only without prefix caching (mamba cache mode
  ``none``; see :mod:`kvcentric.testing.hybrid_models`), whose state cannot be served:
  the connector answers no hits and vLLM computes every token.
- ``deepseek-mla``: MLA stored once for all TP ranks (keys ``.../0of1/...``), at TP = 1 and
  TP = 2, both ranks loading the one copy. vLLM CPU's MLA computes a token through its
  decode kernel when the rest is cached and through SDPA prefill otherwise, and on this
  model the two disagree (a plain engine's greedy tokens for ``q + [t]`` differ from its
  continuation of ``q`` after ``t``: not ours, vLLM CPU turns prefix caching off for MLA).
  So the reader, which computes the prompt's last token by decode, is held to the plain
  engine's decode continuation (:func:`reuse_by_decode`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.testing.hybrid_models import build_hybrid
from kvcentric.testing.servers import VllmServer, connector_config
from tests.helpers.e2e_store import e2e_store

pytestmark = pytest.mark.vllm
HMA_OFF = "Turning off hybrid kv cache manager"
TP = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


def hits(server: VllmServer) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


@contextmanager
def engines(kind: str, logs: Path, store: dict[str, Any], args: Sequence[str] = (),
            env: dict[str, str] | None = None) -> Iterator[dict[str, VllmServer]]:
    """``base`` (no connector), ``writer`` and ``reader`` (kv_both on ``store``), fresh for
    each test: every test is a model (or, for MLA, a TP size) of its own, so no engine could
    serve two tests; the reader is an instance other than the writer (it loads what another
    process stored), and the base a plain engine of the same model (the session's plain
    ``tiny`` engine is another model)."""
    model = str(build_hybrid(kind, Path.cwd() / ".models" / kind))
    made = {name: VllmServer(model, name=kind, args=args, env=env or {},
                             log_path=logs / f"{kind}-{name}.log",
                             kv_transfer=None if name == "base" else connector_config(store))
            for name in ("base", "writer", "reader")}
    try:
        for s in made.values():
            s.start()
        for s in made.values():
            s.wait_ready()
        yield made
    finally:
        for s in made.values():
            s.stop()


def log_of(server: VllmServer) -> str:
    assert server.log_path is not None
    return server.log_path.read_text(errors="replace")


@pytest.fixture
def store(runtime_dir: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    cfg = e2e_store(f"hma-{request.node.name[-20:]}".replace("[", "-").replace("]", ""),
                    "512mb", runtime_dir)
    yield cfg
    launcher.stop(StoreConfig.from_dict(cfg))


def reuse(made: dict[str, VllmServer], p: list[int], want_hit: int) -> None:
    """The writer stores ``p``; the reader, a fresh instance, loads ``want_hit`` tokens of
    it; both answer the plain engine's tokens."""
    want = made["base"].tokens(p, max_tokens=24)
    assert made["writer"].tokens(p, max_tokens=24) == want
    before = hits(made["reader"])
    assert made["reader"].tokens(p, max_tokens=24) == want
    assert hits(made["reader"]) - before == want_hit
    m = made["reader"].metrics()
    assert m.get("vllm:kvcentric_integrity_errors_total", 0) == 0
    assert m.get("vllm:kvcentric_failed_requests_total", 0) == 0


def test_sliding_window_hybrid_reuse_is_exact(tmp_path: Path, store: dict[str, Any]) -> None:
    p = prompt(1, 1100)
    with engines("gemma3-sliding", tmp_path, store) as made:
        reuse(made, p, len(p) - 1)  # blocks and tail: the window's pages of each
        for name in ("writer", "reader"):  # hybrid manager on: two sliding groups, one full
            text = log_of(made[name])
            assert HMA_OFF not in text and "kv cache group sizes (128, 128, 128)" in text


def test_recurrent_state_hybrid_reuse_is_exact(tmp_path: Path, store: dict[str, Any]) -> None:
    p = prompt(2, 1100)
    with engines("lfm2", tmp_path, store) as made:
        reuse(made, p, 1024)  # the state stored at the last block boundary before 1099
        assert made["reader"].metrics()["vllm:kvcentric_loaded_states_total"] >= 1
        for name in ("writer", "reader"):  # hybrid manager on: state and full groups
            text = log_of(made[name])
            assert HMA_OFF not in text and "kv cache group sizes (128, 128)" in text


def test_a_state_that_cannot_be_served_is_recomputed(tmp_path: Path,
                                                     store: dict[str, Any]) -> None:
    p = prompt(3, 700)
    with engines("nemotron-h", tmp_path, store, args=("--no-enable-prefix-caching",)) as made:
        reuse(made, p, 0)
        for name in ("writer", "reader"):
            text = log_of(made[name])
            assert HMA_OFF not in text and "cannot serve this model's KV cache" in text


def reuse_by_decode(made: dict[str, VllmServer], q: list[int], n: int = 4) -> list[int]:
    """The plain engine continues ``q`` with ``t`` and then ``want`` (``t`` by prefill, the
    rest by its decode kernel); the writer stores ``q + [t]``; the reader loads all but its
    last token and computes ``t`` by decode: its first ``n`` tokens must be ``want``'s
    (later ones may drift: the model amplifies the float differences of a batch shape).
    Returns the prompt."""
    base = made["base"].tokens(q, max_tokens=n + 1)
    p, want = q + base[:1], base[1:]
    made["writer"].tokens(p, max_tokens=n)
    before = hits(made["reader"])
    assert made["reader"].tokens(p, max_tokens=n) == want
    assert hits(made["reader"]) - before == len(p) - 1
    assert made["reader"].metrics().get("vllm:kvcentric_integrity_errors_total", 0) == 0
    return p


def test_mla_reuse_is_exact_and_stored_once(tmp_path: Path, store: dict[str, Any]) -> None:
    with engines("deepseek-mla", tmp_path, store) as made:
        reuse_by_decode(made, prompt(4, 1099))
        # 4 blocks of 256 tokens (16 pages of 16) and the tail
        assert made["reader"].metrics()["vllm:kvcentric_loaded_blocks_total"] == 5
    with open_store(store) as st:
        ranks = {k.split("/")[4] for k in st.list_keys("kvc/v2/deepseek-mla/", 100000)}
    assert ranks == {"0of1"}


def test_mla_tp2_stores_one_copy_both_ranks_load_it(tmp_path: Path,
                                                    store: dict[str, Any]) -> None:
    with engines("deepseek-mla", tmp_path, store, args=TP, env=TP_ENV) as made:
        p = reuse_by_decode(made, prompt(5, 1099))
        m = made["reader"].metrics()  # both ranks loaded the one copy of each object
        assert m["vllm:kvcentric_loaded_blocks_total"] == 2 * 5
        saved = made["writer"].metrics()["vllm:kvcentric_saved_blocks_total"]
    with open_store(store) as st:
        keys = st.list_keys("kvc/v2/deepseek-mla/", 100000)
    assert {k.split("/")[4] for k in keys} == {"0of1"}
    # each object once, written by one rank (the counter sums both ranks): 4 blocks, the
    # prompt's tail, the last tail (the reader adds its own last tail: its tokens differ)
    assert saved == len(p) // 256 + 2 and len(keys) == saved + 1
