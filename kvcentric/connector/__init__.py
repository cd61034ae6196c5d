"""Engine integrations: ``kvcentric.connector.vllm`` (vLLM KV connector) and
``kvcentric.connector.sglang`` (SGLang HiCache storage backend). Each translates its
engine's calls into :class:`kvcentric.store.KVStore` calls; neither owns storage."""
