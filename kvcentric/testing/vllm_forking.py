"""vLLM's OpenAI API server whose engine processes are forked from it instead of spawned.

On the CPU, vLLM's platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it checks
the config, so the EngineCore process (and, at TP > 1, each worker process) starts as a
fresh interpreter that imports vLLM, torch and the model code again: most of what an
engine start costs once the API server itself is forked from a pre-imported zygote
(:mod:`kvcentric.testing.zygote`). :func:`main` runs the server with those two process
starts by fork, the start method vLLM itself uses on a GPU whenever CUDA is not yet
initialised in the parent (``vllm.utils.system_utils.get_mp_context``): the child
inherits the parent's imports and runs the same target with the same arguments.

Why fork is sound at those two points: the API server and the EngineCore run no torch
operator before they start their children (no OpenMP pool to inherit; the workers bind
their own threads after they start), and vLLM's shutdown (process groups, sentinels) is
the same for forked and spawned children. What it changes: values vLLM reads from the
environment at import time are the parent's, which for a zygote's fork are the session's
(the zygote documents the same for the API server).

For test sessions and benchmarks that start many engines; production keeps vLLM's own
start method (``python -m vllm.entrypoints.openai.api_server``). Importing this module
imports vLLM's API server (what a zygote loads once for all its forks).
"""

from __future__ import annotations

import importlib
import multiprocessing
from multiprocessing.context import BaseContext
from typing import Any

from vllm.entrypoints.launchers.api_server.entry import main as serve

# the modules that start vLLM's engine processes, each holding its own reference to
# vllm.utils.system_utils.get_mp_context: the EngineCore (CoreEngineProcManager) and the
# TP/PP workers (MultiprocExecutor); data-parallel coordinators keep vLLM's choice
STARTERS = ("vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor")


def fork_context() -> BaseContext:
    """The ``fork`` multiprocessing context (what the patched modules get)."""
    return multiprocessing.get_context("fork")


def use_fork() -> None:
    """Make vLLM start its EngineCore and worker processes by fork in this process and in
    the processes it forks (they inherit the patched modules)."""
    for name in STARTERS:
        module = importlib.import_module(name)
        if not hasattr(module, "get_mp_context"):
            raise RuntimeError(f"{name} no longer starts processes through get_mp_context: "
                               "this vLLM needs kvcentric.testing.vllm_forking updated")
        setattr(module, "get_mp_context", fork_context)  # noqa: B010 (a module typed as ModuleType)


def main() -> Any:
    """``python -m vllm.entrypoints.openai.api_server`` with :func:`use_fork` (argv from
    ``sys.argv``)."""
    use_fork()
    return serve()
