"""The Conductor: kvcentric's cache-aware, OpenAI-compatible router (``kvcentric.router``).

The repository keeps it in the top-level folder ``router/``; it installs only as
``kvcentric.router``. By role:

- :mod:`.conductor`: ``Conductor``, the decision and its bookkeeping (hashes, match,
  decide, dispatched, finished); :mod:`.config`, :mod:`.cli`: its configuration and commands;
  :mod:`.tokenize`, :mod:`.prefix_tokens`, :mod:`.chat_template`: prompts into token ids;
- :mod:`.api`: the HTTP surface (routes, auth, limits, forwarding);
- :mod:`.policies`: the routing policies, the extension point;
- :mod:`.cost`: what a placement costs (profile, processors, Algorithm 1's maths);
- :mod:`.fleet`: instances, residency from events, the store's view, indexer, replication,
  peers;
- :mod:`.ops`: metrics, dashboard, memory.
"""
