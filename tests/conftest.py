"""Shared fixtures: isolated local stores (own runtime dir, stopped after use) and the one
network namespace every Mooncake cluster of the session runs in; and the skip policy of
``make test`` (tests/helpers/skip_policy.py: under ``KVC_NO_SKIPS=1`` only ``gpu`` tests
may skip); the session's pool of plain vLLM engines (tests/helpers/engines.py); every
engine of the session forked from one pre-imported API server (kvcentric.testing.zygote);
and how make test runs its parallel and serial passes (tests/helpers/xdist_groups.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.netns import NetNamespace, unavailable_reason
from kvcentric.testing.servers import VllmServer
from kvcentric.testing.zygote import FORKING_VLLM_ENTRY, Zygote
from tests.helpers.e2e_store import TEST_HOT_TIMEOUT_S
from tests.helpers.engines import engine_pool, plain_tiny  # noqa: F401 (session fixtures)
from tests.helpers.hermetic import isolate
from tests.helpers.skip_policy import (  # noqa: F401 (pytest hooks, registered here)
    pytest_make_collect_report,
    pytest_runtest_makereport,
)
from tests.helpers.xdist_groups import (  # noqa: F401 (pytest hooks, registered here)
    bind_worker,
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
)

_HOME = pytest.StashKey[Path]()
_ZYGOTE = pytest.StashKey[Zygote]()


def pytest_configure(config: pytest.Config) -> None:
    """The session's own environment before any test module imports vLLM: no usage
    statistics, caches below a temporary directory removed at the end
    (tests/helpers/hermetic.py); engines and stores the tests start inherit it."""
    home = Path(tempfile.mkdtemp(prefix="kvc-test-home-"))
    config.stash[_HOME] = home
    isolate(os.environ, home)
    bind_worker(os.environ)
    # engines of this session fork from one process that imported vLLM's API server
    # (started with the first engine; kvcentric.testing.zygote), and each forks its
    # EngineCore and workers in turn (kvcentric.testing.vllm_forking)
    zygote = Zygote(home / "zygote.sock", home / "zygote.log", entry=FORKING_VLLM_ENTRY)
    config.stash[_ZYGOTE] = zygote
    VllmServer.zygote = zygote


def pytest_unconfigure(config: pytest.Config) -> None:
    zygote = config.stash.get(_ZYGOTE, None)
    if zygote is not None:
        VllmServer.zygote = None
        zygote.close()
    home = config.stash.get(_HOME, None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def runtime_dir() -> Iterator[Path]:
    """A private tmpfs directory for every local store the test session starts."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"kvc-test-{os.getpid()}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store_cfg(runtime_dir: Path) -> Iterator[StoreConfig]:
    """A fresh local store config (64 MiB); its coordinator is stopped at teardown.

    Its hot-path timeout is 1 s, not the default 0.1 s: on a shared 2-core box the
    coordinator is now and then descheduled for more than 100 ms (measured at load 5.6:
    6 of 188k calls), which trips the client's breaker, and tests that check what a call
    returns are not about that. tests/store/test_store_hung.py tests the bound itself."""
    cfg = StoreConfig.from_dict({"name": f"t{uuid.uuid4().hex[:10]}", "capacity_bytes": 64 << 20,
                                 "runtime_dir": runtime_dir, "op_timeout_s": 10.0,
                                 "hot_timeout_s": TEST_HOT_TIMEOUT_S})
    yield cfg
    launcher.stop(cfg)


@pytest.fixture(scope="session")
def mooncake_ns() -> Iterator[NetNamespace]:
    """The private network namespace of every Mooncake cluster in this test session.

    One for the whole session, not one per module: Mooncake's I/O threads are process-wide
    and stay in the namespace of the first client this process makes, so a client made
    later in another namespace would talk to the first one's (dead) master.
    """
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no netns: {reason}")
    ns = NetNamespace().start()
    yield ns
    ns.stop()


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    """The tiny random-weight model (built once under .models/, reused after)."""
    from kvcentric.testing.models import build_model  # heavy imports: only when used

    return str(build_model("tiny", Path.cwd() / ".models" / "tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: str) -> Any:
    """The router's tokenizer (``PromptTokenizer``) over the tiny model."""
    from kvcentric.router.tokenize import PromptTokenizer

    return PromptTokenizer(tiny_dir)
