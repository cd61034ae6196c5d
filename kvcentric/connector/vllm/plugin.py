"""vLLM plugin (``vllm.general_plugins`` entry point): registers ``KVCentricConnector``
so ``--kv-transfer-config '{"kv_connector":"KVCentricConnector",...}'`` works without
``kv_connector_module_path``. vLLM calls :func:`register` once in every process."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KVCentricConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "KVCentricConnector", "kvcentric.connector.vllm", "KVCentricConnector")
