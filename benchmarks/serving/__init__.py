"""Serving: real engines (or any OpenAI endpoint) under load, every arm in the same run.

The load generator (:mod:`.loadgen`) and the comparisons (:mod:`.compare`) are built from:

- :mod:`.tokens`: token-exact synthetic prompts from the model's own tokenizer (text where
  its word tokens allow, token ids with any tokenizer).
- :mod:`.workloads`: multi-turn, shared-prefix and hit-ratio sessions; :mod:`.trace`:
  Mooncake-trace replay with token synthesis from ``hash_ids``.
- :mod:`.client`: one streamed request over ``httpx`` with TTFT/ITL timing.
- :mod:`.runner`: drives sessions on an asyncio loop (arrivals, think time, round-robin).
- :mod:`.metrics`: per-request records to ``vllm bench serve``-style aggregates.
- :mod:`.scrape`: the servers' cache-hit counters from ``/metrics`` before and after a run.
- :mod:`.utilisation`: each instance's running/waiting requests and KV usage sampled from
  ``/metrics`` during a run (busy fraction, load balance, box plots).
- :mod:`.fleet`, :mod:`.gateways`, :mod:`.report`: instances, routers in front of them,
  and the outputs of a side-by-side comparison.
"""
