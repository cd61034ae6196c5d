"""What a placement costs: the cost model, the processors engines share, Algorithm 1's maths.

- :mod:`.cost_model`: ``Profile``, the fitted prefill and TBT model;
- :mod:`.profile`: measures an instance and fits that profile (``kvcentric-router profile``);
- :mod:`.processor`: queued prefill work per processor (serial or fair sharing);
- :mod:`.decision`: Mooncake's Algorithm 1 (``choose``), the cost of each candidate pair.

The policies that use them are the extension point :mod:`kvcentric.router.policies`.
"""
