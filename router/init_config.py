"""The smallest router config, shipped inside the package: ``kvcentric-router init``.

``configs/router.yaml`` (every setting, commented) lives in the repository only; a user
who installed the wheel gets this one instead: ``model``, ``tokenizer``, ``listen`` and
``instances``, each explained, everything else left to its default.

Contract: :func:`render` returns YAML that :func:`kvcentric.router.config.load_config`
accepts for any model name, folder path and ``http://`` URLs it is given (strings are
written JSON-quoted, which YAML reads back unchanged); it never checks that the folder or
the engines exist (``kvcentric doctor --router-config`` does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

DEFAULT_INSTANCE = "http://127.0.0.1:8100"

_TEMPLATE = """\
# kvcentric router (the Conductor), written by `kvcentric-router init`.
#   check it:  kvcentric doctor --router-config {path}
#   run it:    kvcentric-router serve --config {path}
# Relative paths are relative to the directory the router is started from.

# The model name the engines serve (vLLM's --served-model-name, else its --model);
# requests naming another model get 404.
model: {model}

# A local model folder (Hugging Face layout), not a hub id: the router reads the tokenizer
# (tokenizer.json or tokenizer_config.json, and the chat template) and config.json (to size
# the KV cache). Any folder holding the served model's tokenizer and config.json will do,
# e.g. the one the engine loads.
tokenizer: {tokenizer}

# Where the router listens. Without API keys (auth.api_keys) it refuses a non-loopback host.
listen: {{host: {host}, port: {port}}}

# The engines. role: both (vLLM kv_role kv_both, or no connector), prefill (kv_producer)
# or decode (kv_consumer). Add kv_events: tcp://127.0.0.1:PORT and start the engine with
#   --kv-events-config '{{"enable_kv_cache_events":true,"publisher":"zmq",
#                        "endpoint":"tcp://127.0.0.1:PORT","topic":"kv"}}'
# for exact per-engine residency (without it the router keeps its own LRU bookkeeping).
instances:
{instances}

# The store the engines' connectors use (the same as their "store" extra config); the
# router only asks it which blocks exist. Uncomment when the engines run kvcentric's
# connector:
# store: {{backend: local, name: default}}

# Every other section (slo, cost, keys, limits, auth, health, upstream, replication, ...)
# has defaults; the README's "The router (Conductor)" section describes each.
"""


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML string, whatever it holds


def render(path: str, model: str, tokenizer: str, instances: Sequence[str] = (DEFAULT_INSTANCE,),
           host: str = "127.0.0.1", port: int = 8000) -> str:
    """The commented minimal config naming ``model``, the ``tokenizer`` folder and the
    engines at ``instances`` (role ``both``); ``path`` appears in its usage lines."""
    lines = "\n".join(f"  - {{url: {_q(url)}, role: both}}" for url in instances)
    return _TEMPLATE.format(path=path, model=_q(model), tokenizer=_q(tokenizer),
                            host=_q(host), port=int(port), instances=lines or "  []")
