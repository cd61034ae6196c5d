"""The router's HTTP surface: what clients, operators and gateways call.

- :mod:`.app`: ``build_app`` and ``RouterState``: the Starlette app, its lifespan, routes;
- :mod:`.openai_routes`, :mod:`.admin_routes`, :mod:`.indexer_routes`: the OpenAI API,
  the admin API, Mooncake's Conductor indexer API;
- :mod:`.api_models`, :mod:`.openapi`: request bodies as typed models, the OpenAPI document;
- :mod:`.auth`, :mod:`.access_config`, :mod:`.limits`, :mod:`.errors`: keys and tenants,
  their config, request bounds and rate limits, error bodies;
- :mod:`.proxy`, :mod:`.upstream`, :mod:`.transport`, :mod:`.relay`: forwarding to the
  chosen engines, one connection pool each over aiohttp's client, a streamed answer
  relayed as it comes (a client that leaves ends it).
"""
