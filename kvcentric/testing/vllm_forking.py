"""vLLM's OpenAI API server whose engine processes are forked from it instead of spawned.

On the CPU, vLLM's platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it checks
the config, so the EngineCore process (and, at TP > 1, each worker process) starts as a
fresh interpreter that imports vLLM, torch and the model code again: most of what an
engine start costs once the API server itself is forked from a pre-imported zygote
(:mod:`kvcentric.testing.zygote`). :func:`main` runs the server with those two process
starts by fork, the start method vLLM itself uses on a GPU whenever CUDA is not yet
initialised in the parent (``vllm.utils.system_utils.get_mp_context``): the child
inherits the parent's imports and runs the same target with the same arguments.

The same goes for vLLM's model-class inspection (``registry._run_in_subprocess``), which
runs in a fresh interpreter importing vLLM on the first engine of each architecture per
cache directory (a session's own): :func:`run_forked` runs it in a forked child instead.
vLLM isolates it to keep CUDA uninitialised in the server; on the CPU there is none, and
the child still keeps whatever the model's import does out of the server.

Why fork is sound at those points: the API server and the EngineCore run no torch
operator before they start their children (no OpenMP pool to inherit; the workers bind
their own threads after they start; the inspection child only imports a model class),
and vLLM's shutdown (process groups, sentinels) is the same for forked and spawned
children. What it changes: values vLLM reads from the environment at import time are the
parent's, which for a zygote's fork are the session's (the zygote documents the same for
the API server).

For test sessions and benchmarks that start many engines; production keeps vLLM's own
start method (``python -m vllm.entrypoints.openai.api_server``). Importing this module
imports vLLM's API server and the modules each engine start would otherwise import after
its fork (what a zygote loads once for all its forks; it then freezes its heap).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

# vLLM's API server, and what every engine start imports after its fork unless it is
# already here: the modules use_fork patches, the EngineCore, its executors and CPU
# worker, the model loader, the Llama family (the tests' models), the KV-connector
# factory and this package's connector. Imported once in a zygote, each fork inherits them
import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
import vllm.model_executor.model_loader  # noqa: F401
import vllm.model_executor.models.llama  # noqa: F401
import vllm.model_executor.models.registry  # noqa: F401
import vllm.v1.engine.core  # noqa: F401
import vllm.v1.engine.utils  # noqa: F401
import vllm.v1.executor.multiproc_executor  # noqa: F401
import vllm.v1.executor.uniproc_executor  # noqa: F401
import vllm.v1.worker.cpu_model_runner  # noqa: F401
import vllm.v1.worker.cpu_worker  # noqa: F401
from vllm.entrypoints.launchers.api_server.entry import main as serve

import kvcentric.connector.vllm.connector  # noqa: F401

# the modules that start vLLM's engine processes, each holding its own reference to
# vllm.utils.system_utils.get_mp_context: the EngineCore (CoreEngineProcManager) and the
# TP/PP workers (MultiprocExecutor); data-parallel coordinators keep vLLM's choice
STARTERS = ("vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor")
REGISTRY = "vllm.model_executor.models.registry"
_T = TypeVar("_T")


def fork_context() -> BaseContext:
    """The ``fork`` multiprocessing context (what the patched modules get)."""
    return multiprocessing.get_context("fork")


def run_forked(fn: Callable[[], _T]) -> _T:
    """``fn()`` in a forked child; its result (pickled) or its error comes back. Blocks
    until the child exits; what ``fn`` imports or allocates stays in the child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(r)
            try:
                data = pickle.dumps((True, fn()))
            except BaseException:
                data, code = pickle.dumps((False, traceback.format_exc())), 1
            with os.fdopen(w, "wb") as out:
                out.write(data)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("the forked child died before it answered")
    ok, value = pickle.loads(data)
    if not ok:
        raise RuntimeError(f"Error raised in subprocess:\n{value}")
    result: _T = value
    return result


def _patch(module_name: str, attr: str, value: Any) -> None:
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise RuntimeError(f"{module_name} has no {attr} any more: this vLLM needs "
                           "kvcentric.testing.vllm_forking updated")
    setattr(module, attr, value)


def use_fork() -> None:
    """Make vLLM start its EngineCore and worker processes, and inspect model classes, by
    fork in this process and in the processes it forks (they inherit the patches)."""
    for name in STARTERS:
        _patch(name, "get_mp_context", fork_context)
    _patch(REGISTRY, "_run_in_subprocess", run_forked)


def main() -> Any:
    """``python -m vllm.entrypoints.openai.api_server`` with :func:`use_fork` (argv from
    ``sys.argv``)."""
    use_fork()
    return serve()
