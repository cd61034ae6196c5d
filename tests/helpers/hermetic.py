"""The test session's own environment: no usage statistics, caches in a directory of its
own (not under ``$HOME``), engines with a small KV cache, set before any engine starts.

:func:`isolate` is called from ``pytest_configure`` (tests/conftest.py), before test
modules are imported, so vLLM, torch and Hugging Face read it in this process, and every
engine, store and worker a test starts inherits it (they are given ``os.environ`` plus
their own keys: kvcentric.testing.servers, kvcentric.store.local.launcher).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path

# vLLM's usage reporter honours VLLM_NO_USAGE_STATS and DO_NOT_TRACK (and its own
# VLLM_DO_NOT_TRACK); Hugging Face Hub its own switch
NO_TELEMETRY = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_DO_NOT_TRACK": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"}


def cache_dirs(home: Path) -> dict[str, str]:
    """The cache and config directories the engines' libraries write, all below ``home``."""
    return {"XDG_CACHE_HOME": str(home / "cache"),
            "XDG_CONFIG_HOME": str(home / "config"),
            "VLLM_CACHE_ROOT": str(home / "cache" / "vllm"),
            "VLLM_CONFIG_ROOT": str(home / "config" / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(home / "cache" / "torchinductor"),
            "TRITON_CACHE_DIR": str(home / "cache" / "triton")}


# KV cache of each engine a test starts (kvcentric.testing.servers.KV_BYTES_ENV): a tiny
# model's 4 KiB a token gives 65,536 tokens, sixteen of the longest context the tests use;
# vLLM's CPU default of a GiB per rank, with several engines up on each of make test's two
# workers, pushed the box past its memory and into reclaim
ENGINE_KV_BYTES = {"KVC_ENGINE_KV_CACHE_BYTES": str(256 << 20)}
# a one-rank engine's worker in its EngineCore process (kvcentric.testing.servers.EXECUTOR_ENV):
# the process layout vLLM has on a GPU for one rank, and on the CPU one of the three
# processes that each import vLLM (seconds of CPU each) fewer per engine start
ENGINE_EXECUTOR = {"KVC_ENGINE_EXECUTOR": "uni"}
# torch.compile off in every process of the session: the engines run eagerly anyway
# (--enforce-eager), but vLLM still compiles a few helpers with inductor on their first
# call (at TP > 1 the vocab-parallel embedding's mask, get_masked_input_and_mask): a C++
# build of seconds per worker process, on every engine's first request
NO_COMPILE = {"TORCHDYNAMO_DISABLE": "1"}


def isolate(environ: MutableMapping[str, str], home: Path) -> None:
    """Turn telemetry off and point the caches below ``home`` (created) in ``environ``.

    Hugging Face's hub cache is the one cache kept where it was (``HF_HOME``, resolved
    from the environment before ``XDG_CACHE_HOME`` moves): the tests read tokenizers
    and models installed there and never download, so a fresh one would be empty."""
    if "HF_HOME" not in environ:
        xdg = environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
        environ["HF_HOME"] = str(Path(xdg) / "huggingface")
    environ.update(NO_TELEMETRY)
    for k, v in {**ENGINE_KV_BYTES, **ENGINE_EXECUTOR, **NO_COMPILE}.items():
        environ.setdefault(k, v)
    dirs = cache_dirs(home)
    for d in dirs.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    environ.update(dirs)
