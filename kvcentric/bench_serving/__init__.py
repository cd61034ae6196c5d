"""bench_serving: how does an OpenAI-compatible endpoint serve multi-turn, shared-prefix or
trace load? Installed with the package: ``python -m kvcentric.bench_serving --help`` (or
``kvcentric bench --help``) against any endpoint, with any local tokenizer folder.

- :mod:`.tokens`: token-exact synthetic prompts from the model's own tokenizer (text where
  its word tokens allow, token ids with any tokenizer).
- :mod:`.workloads`: multi-turn, shared-prefix and hit-ratio sessions; :mod:`.trace`:
  Mooncake-trace replay (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``)
  with token synthesis from ``hash_ids``.
- :mod:`.client`: one streamed request over ``httpx`` with TTFT/ITL timing.
- :mod:`.runner`: drives sessions on an asyncio loop (arrivals, think time, round-robin).
- :mod:`.metrics`: per-request records to ``vllm bench serve``-style aggregates and SLO
  goodput.
- :mod:`.scrape`: the servers' cache-hit counters from ``/metrics`` before and after a run.
- :mod:`.utilisation`: each instance's running/waiting requests and KV usage sampled from
  ``/metrics`` during a run (busy fraction, load balance).
- :mod:`.loadgen`: the command line and :func:`~.loadgen.benchmark`, one run's result.

Importing it starts nothing; httpx and transformers (the ``router`` extra) are imported
where a run needs them, so ``--help`` works on a plain install.
"""
