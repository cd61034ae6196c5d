"""What the router knows of the fleet: instances, their caches, the store, its peers.

- :mod:`.instance_spec`, :mod:`.instances`: an instance as configured, and its live state
  (queue, batch, health, the registry);
- :mod:`.engine_metrics`: the engines' ``/metrics`` gauges the router polls;
- :mod:`.kv_events`, :mod:`.prefix_index`: vLLM's KV events and the residency they build;
- :mod:`.store_view`, :mod:`.store_events`: what the store holds (cached lookups, its events);
- :mod:`.indexer`, :mod:`.indexer_feeds`: the standard indexer behind ``/query`` and the
  publishers registered with it;
- :mod:`.heat`, :mod:`.replication`: decayed prefix heat, hot prefixes warmed on idle
  instances;
- :mod:`.landings`: prefixes in-flight prefills are about to store (a request may wait
  for one and load it);
- :mod:`.peers`: router replicas booking each other's dispatches.
"""
