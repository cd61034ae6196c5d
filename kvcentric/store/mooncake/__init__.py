"""The ``mooncake`` store backend: Mooncake Store (``mooncake_master`` + storage nodes).

- ``store``: ``MooncakeStore``, the :class:`~kvcentric.store.KVStore` over Mooncake's client.
- ``config``: the ``mooncake`` section of the store config (and ``MOONCAKE_*`` env).
- ``ops``: ``ClientOps``, the one client with its breaker, bounded calls (``calls``),
  counters and staging, through which ``store``, ``reads`` and ``checksums`` reach it.
- ``client``: opening Mooncake's client; ``staging``: registered staging memory;
  ``health``: reachability and reconnects; ``codes``: Mooncake's error codes mapped to ours;
  ``rdma``: NIC discovery; ``http``: the metadata server; ``service``: the
  ``kvcentric store mooncake-*`` commands (master, storage node).

Nothing here imports the Mooncake wheel at import time.
"""
