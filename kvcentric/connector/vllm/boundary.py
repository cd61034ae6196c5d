"""The vLLM boundary: vLLM's types for the connector's hooks, the hook list, the version gate.

Everything kvcentric takes from vLLM's connector API is named here once:

- The types of the hooks' arguments (``Request``, ``KVCacheBlocks``, ``SchedulerOutput``,
  ``KVConnectorOutput``, ``ForwardContext``, ...), imported under ``TYPE_CHECKING`` so that
  importing this module never imports vLLM's scheduler or model code. The connector's hook
  methods are annotated with these classes, so ``make lint`` (mypy, which follows the
  installed vLLM: it ships ``py.typed``) fails when a vLLM release changes a hook's
  signature; tests/connector/test_vllm_boundary.py holds that.
- :data:`HOOKS`: hooks whose absence would break a promise silently (no recompute after a
  failed load, no stats); vLLM versions without them are refused at start.
- :func:`check_vllm`: the start-up gate (and the doctor's ``vllm-version`` check), under
  the version policy of :mod:`kvcentric.compat`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcentric.compat import API_CHECKED_VLLM, MIN_VLLM, TESTED_VLLM, check_engine, missing_attrs

if TYPE_CHECKING:
    from vllm.config import VllmConfig as VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric as PromMetric
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetricT as PromMetricT
    from vllm.forward_context import ForwardContext as ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata as AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks as KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig as KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput as KVConnectorOutput
    from vllm.v1.request import Request as Request

# the types above (``X as X``: re-exported) exist for type checkers only: import them
# from here under TYPE_CHECKING
__all__ = ["HOOKS", "check_vllm"]

HOOKS = ("get_block_ids_with_load_errors", "get_kv_connector_stats", "build_kv_connector_stats",
         "build_prom_metrics", "bind_connector_metadata", "request_finished",
         "register_kv_caches", "wait_for_layer_load", "save_kv_layer")


def check_vllm() -> None:
    """Raise ``RuntimeError`` when the installed vLLM is older than
    :data:`kvcentric.compat.MIN_VLLM` or lacks one of :data:`HOOKS` (or
    ``KVTransferConfig.kv_load_failure_policy``); log a line for an untested version."""
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    missing = missing_attrs(KVConnectorBase_V1, HOOKS, "KVConnectorBase_V1")
    if "kv_load_failure_policy" not in getattr(KVTransferConfig, "__dataclass_fields__", {}):
        missing.append("KVTransferConfig.kv_load_failure_policy")
    check_engine("vLLM", str(vllm.__version__), TESTED_VLLM, missing, MIN_VLLM,
                 API_CHECKED_VLLM)
