"""Operating the router: its metrics, its dashboard, its memory.

- :mod:`.metrics`: ``kvc_router_*`` Prometheus metrics;
- :mod:`.dashboard`: ``GET /dashboard``, a live HTML page over ``/metrics``;
- :mod:`.memory`: ``HeapTrimmer``, the free heap glibc holds goes back to the system.
"""
