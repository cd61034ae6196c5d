"""The vLLM plugin entry point registers KVCentricConnector by name."""

from importlib.metadata import entry_points


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvcentric") == "kvcentric.connector.vllm.plugin:register"


def test_vllm_loads_plugin_and_resolves_the_name() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    from kvcentric.connector.vllm import KVCentricConnector
    from kvcentric.connector.vllm.plugin import register

    load_general_plugins()  # what every vLLM process runs at start-up
    register()  # idempotent: a second registration must not raise
    cfg = KVTransferConfig(kv_connector="KVCentricConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is KVCentricConnector
