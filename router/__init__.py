"""The Conductor: kvcentric's cache-aware, OpenAI-compatible router (``kvcentric.router``).

The repository keeps it in the top-level folder ``router/``; it installs only as
``kvcentric.router``. ``app`` is the HTTP front, ``decision`` + ``cost_model`` + ``profile``
pick the prefill/decode pair, ``instances`` + ``kv_events`` + ``prefix_index`` +
``store_view`` keep the residency view, ``proxy`` forwards, ``scheduler`` queues and admits.
"""
