"""kvcentric: KVCache-centric serving for vLLM and SGLang.

Prefill KV goes into a global store keyed by chained block hashes; any instance that later
sees the same prefix loads it instead of recomputing it. The map: docs/architecture.md.
"""

__version__ = "0.1.0"
