"""``KVCentricConnector``: kvcentric as a vLLM KV connector (a thin facade).

Use it with::

    --kv-transfer-config '{"kv_connector":"KVCentricConnector",
        "kv_connector_module_path":"kvcentric.connector.vllm", "kv_role":"kv_both",
        "kv_connector_extra_config":{"store":{"backend":"local","capacity":"8gb"}}}'

(with kvcentric installed, the ``vllm.general_plugins`` entry point registers the name,
so ``kv_connector_module_path`` may be left out). Roles: ``kv_producer`` only saves,
``kv_consumer`` only loads, ``kv_both`` does both.

The scheduler-side logic lives in :mod:`kvcentric.connector.vllm.scheduler`, the worker
side in :mod:`kvcentric.connector.vllm.worker`; this class only routes vLLM's calls.

Hybrid models: the connector implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid
KV cache manager on (sliding-window and recurrent-state groups of their own); what each
group stores and loads is in :mod:`kvcentric.connector.vllm.groups`.

CUDA graphs: vLLM's default ``FULL_AND_PIECEWISE`` stays on. A step that replays a full
graph runs none of the layer hooks, so the worker then loads before and saves after the
forward (:func:`layer_hooks_run`); ``full_cudagraphs: false`` asks vLLM for PIECEWISE
graphs instead (:meth:`KVCentricConnector.requires_piecewise_for_cudagraph`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvcentric.connector.vllm.affinity import spare_thread
from kvcentric.connector.vllm.boundary import check_vllm
from kvcentric.connector.vllm.engine_layout import engine_layout, model_revision
from kvcentric.connector.vllm.metadata import KVCentricMetadata
from kvcentric.connector.vllm.scheduler import KVCentricScheduler
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.stats import KVCentricPromMetrics, KVCentricStats
from kvcentric.connector.vllm.worker import KVCentricWorker
from kvcentric.store import open_store

if TYPE_CHECKING:
    import torch

    from kvcentric.connector.vllm.boundary import (
        AttentionMetadata,
        ForwardContext,
        KVCacheBlocks,
        KVCacheConfig,
        KVConnectorOutput,
        PromMetric,
        PromMetricT,
        Request,
        SchedulerOutput,
        VllmConfig,
    )

__all__ = ["KVCentricConnector", "check_vllm", "layer_hooks_run"]

log = logging.getLogger("kvcentric.connector")


def _tp_rank(role: KVConnectorRole) -> int:
    if role != KVConnectorRole.WORKER:
        return 0  # the scheduler looks up rank 0's keys on behalf of all ranks
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _describe_groups(layout: Any) -> str:
    groups = layout.groups
    if groups is None:
        return ", async loads" if layout.async_loads else ""
    kinds = ", ".join(f"{g.kind}{'/' + str(g.window) if g.window else ''}: {len(g.layers)}"
                      for g in (*groups.attention, *groups.states))
    return f", KV cache groups ({kinds}), {'async' if layout.async_loads else 'sync'} loads"


def layer_hooks_run(forward_context: ForwardContext | None) -> bool:
    """True only when this step's attention layers will call ``wait_for_layer_load`` and
    ``save_kv_layer``: ``start_load_kv`` runs inside the forward's own context (attention
    metadata bound) and the step does not replay a full CUDA graph (whose captured
    attention ops run no Python). vLLM's model runner v2 starts a full graph's loads
    outside any forward context, so an unknown context counts as no hooks too."""
    if forward_context is None or forward_context.attn_metadata is None:
        return False
    return bool(forward_context.cudagraph_runtime_mode != CUDAGraphMode.FULL)


class KVCentricConnector(KVConnectorBase_V1, SupportsHMA):
    """Layer-wise streaming save and load of prefix KV through a kvcentric store."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        check_vllm()
        if kv_cache_config is None:
            raise ValueError("KVCentricConnector needs vLLM's kv_cache_config")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tcfg = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(tcfg.kv_connector_extra_config)
        if tcfg.kv_role == "kv_producer":
            self.settings = replace(self.settings, async_commit=False)
        model_id = self.settings.model_id or str(vllm_config.model_config.served_model_name)
        page = int(vllm_config.cache_config.block_size)
        self.layout = engine_layout(vllm_config, kv_cache_config,
                                    self.settings.stored_block_size(page), model_id,
                                    _tp_rank(role),
                                    model_revision(vllm_config, self.settings.model_revision))
        if self.settings.loads_async(str(tcfg.kv_role)):
            self.layout = replace(self.layout, load_async=True)
        # a cache never stops vLLM (required=False); a worker opens it on a spare CPU, so
        # the store client's own threads inherit that CPU, not the compute cores
        opener = spare_thread if role != KVConnectorRole.SCHEDULER and \
            self.settings.spare_cpu_threads else _call
        store = opener(partial(open_store, self.settings.store, required=False))
        self._scheduler: KVCentricScheduler | None = None
        self._worker: KVCentricWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            # a cache is best effort: a failed load recomputes instead of failing the request
            tcfg.kv_load_failure_policy = self.settings.load_failure_policy  # type: ignore[assignment]
            self._scheduler = KVCentricScheduler(self.settings, self.layout, store,
                                                 loads=tcfg.is_kv_consumer,
                                                 saves=tcfg.is_kv_producer)
        else:
            groups = self.layout.groups
            names = list(groups.layers if groups is not None
                         else kv_cache_config.kv_cache_groups[0].layer_names)
            # a P/D prefill's blocks are soft-pinned until the decode reads them
            pin_s = self.settings.handoff_pin_s if tcfg.kv_role == "kv_producer" else 0.0
            self._worker = KVCentricWorker(self.settings, self.layout, store, names, pin_s)
        log.info("kvcentric %s: role %s, store %s/%s, stored block %d tokens (%d pages), "
                 "object %d B, keys %s%s", role.name.lower(), tcfg.kv_role,
                 self.settings.store.backend, self.settings.store.name,
                 self.layout.stored_block_size, self.layout.pages_per_object,
                 self.layout.geometry.object_bytes, self.layout.keyspace.prefix,
                 _describe_groups(self.layout))
        if self.layout.failures_by_request and \
                "get_transfer_results" not in vars(KVConnectorBase_V1):
            # without it a failed load of a multi-group model could not be reported
            raise ValueError("kvcentric serves hybrid models (several KV cache groups) on "
                             "vLLM versions with KVConnectorBase_V1.get_transfer_results")
        if not self.layout.servable:
            assert self.layout.groups is not None
            log.warning("kvcentric cannot serve this model's KV cache (%s): it answers no "
                        "hits and saves nothing; vLLM computes every token",
                        self.layout.groups.unservable)

    @property
    def sched(self) -> KVCentricScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> KVCentricWorker:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a preempted request may simply recompute

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM asks this before capturing graphs (``VllmConfig``): full graphs are safe
        with us (see the module docstring) unless ``full_cudagraphs`` is false."""
        return not ConnectorSettings.from_extra_config(extra_config).full_cudagraphs

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self.sched.register_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.sched.loads_failed(getattr(connector_output, "failed_recving", None))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.sched.request_finished(request)
        return False, None  # saves finish within the step: blocks can be freed now

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the same as :meth:`request_finished`, for every group."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVCentricMetadata)
        self.worker.plan_saves(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCentricMetadata)
        self.worker.start_load(meta, hooks_run=layer_hooks_run(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self.worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self.worker.finish_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, _ = self.worker.take_transfer_results()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The asynchronous loads done since the last step (failed ones too: a hybrid
        model's are named here, vLLM recomputes them; block ids cannot name a request
        with several KV cache groups; any other model's failed pages are block ids)."""
        done, failed = self.worker.take_transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    # vLLM >= 0.33 sleep mode (``supports_sleep_mode`` keeps its default, True): vLLM
    # drains transfers, calls this, remaps the KV cache memory, then ``restore_kv_caches``
    def unregister_kv_caches(self) -> None:
        self.worker.suspend()

    def restore_kv_caches(self) -> None:
        self.worker.resume()

    # ---- both sides ----
    def get_kv_connector_stats(self) -> KVCentricStats | None:
        side = self._scheduler or self._worker
        return KVCentricStats.from_counters(side.stats) if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVCentricStats:
        return KVCentricStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVCentricPromMetrics:
        return KVCentricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        elif self._scheduler is not None:
            self._scheduler.store.close()
