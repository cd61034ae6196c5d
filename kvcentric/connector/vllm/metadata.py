"""What the scheduler side tells the workers each step (pickled with the SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec

__all__ = ["KVCentricMetadata", "TransferSpec"]


@dataclass
class KVCentricMetadata(StepPlan, KVConnectorMetadata):
    """A :class:`~kvcentric.connector.vllm.transfers.StepPlan` as vLLM's connector
    metadata."""
