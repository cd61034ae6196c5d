"""The hot-path bound tests run their stores with, and the store section that end-to-end
tests give their vLLM CPU engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The engines' default hot-path bound is 0.1 s. On the 2-core CI box, right after a forward
# pass, three CPU engines' threads kept the coordinator off the cores past it: an acquire
# timed out and the reader recomputed 9 blocks (correct, and counted as a failed request)
# where the test asserts exact hits. What the 0.1 s bound promises is held by the tests
# written for it: tests/store/test_store_hung.py, tests/store/test_store_mooncake_hung.py
# and the stop matrix (tests/e2e/test_faults.py).
TEST_HOT_TIMEOUT_S = 1.0  # also conftest's store_cfg and MooncakeCluster.store_config
# The engines of the end-to-end tests wait longer still: under make test's second xdist
# worker (its multi-process store stress tests next to a TP=2 engine pair) a writer's
# reserve once waited past 1 s, the store held part of the prompt, and a reader that was
# to load all but the last token computed the rest by prefill instead: correct, but not
# the exact tokens those tests compare (a random model's near-tied logits).
E2E_HOT_TIMEOUT_S = 5.0


def e2e_store(name: str, capacity: str, runtime_dir: Path, **extra: Any) -> dict[str, Any]:
    """A local store section named ``name`` in ``runtime_dir``, with the e2e hot bound."""
    return {"name": name, "capacity": capacity, "runtime_dir": str(runtime_dir),
            "hot_timeout_s": E2E_HOT_TIMEOUT_S, **extra}
