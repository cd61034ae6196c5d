"""kvcentric as a vLLM KV connector (``KVConnectorBase_V1``); see docs/connector.md.

Owns everything that runs inside a vLLM process:

- ``connector``: the facade vLLM instantiates; routes each call to one side.
- ``boundary``: the typed vLLM boundary: vLLM's hook types, the hook list, the version gate.
- ``scheduler``: scheduler side (store lookups, what to load per step); ``request_keys``:
  each request's store keys; ``save_plan``: what to save per step.
- ``worker``: worker side (leases, layer-wise loads and saves); ``commits``: publishing
  saves; ``states``: hybrid models' recurrent-state objects.
- ``mover``: page plans between vLLM's paged cache and store objects.
- ``engine_layout``: keys and object geometry derived from vLLM's configs; ``groups``: a
  hybrid model's KV cache groups (``SupportsHMA``).
- ``settings``: ``kv_connector_extra_config`` parsed once; ``metadata``: the per-step
  scheduler → worker message; ``stats``: counters and Prometheus metrics;
  ``plugin``: the ``vllm.general_plugins`` entry point (version policy: ``kvcentric.compat``).

``kv_connector_module_path: kvcentric.connector.vllm`` keeps working: the class is resolved
on first attribute access, so importing a submodule (the router imports ``settings``)
never imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCentricConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVCentricConnector":
        from kvcentric.connector.vllm.connector import KVCentricConnector

        return KVCentricConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
