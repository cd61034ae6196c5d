"""Serving: real engines (or any OpenAI endpoint) under load, every arm in the same run.

The load generator is the installed :mod:`kvcentric.bench_serving` (:mod:`.loadgen` runs it
with the repository's result files); the comparisons (:mod:`.compare`) add:

- :mod:`.utilisation`: box plots of each instance's load over a run.
- :mod:`.fleet`, :mod:`.gateways`, :mod:`.report`: instances, routers in front of them,
  and the outputs of a side-by-side comparison.
"""
