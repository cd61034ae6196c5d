"""Engine integrations: ``kvcentric.connector.vllm`` (vLLM KV connector) and
``kvcentric.connector.sglang`` (SGLang HiCache storage backend)."""
