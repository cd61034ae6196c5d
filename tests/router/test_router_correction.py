"""The cost model's per-processor correction learns the engine's prefill time, measured
from dispatch: the router's own time before it (a slow store lookup, a busy event loop)
is no instance's fault and must not make that instance look slower than its peers."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from benchmarks.lib.stub_engine import build_app
from kvcentric.router.api.proxy import Proxy
from kvcentric.router.api.relay import RelayResponse
from kvcentric.router.conductor import Conductor
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.store_view import StoreView
from kvcentric.router.ops.metrics import RouterMetrics
from kvcentric.router.tokenize import PromptTokenizer

ENGINE_S = 0.05  # the stub engine's answer time, and the profile's prefill prediction
ROUTER_S = 0.3  # the router's own time before dispatch


def test_correction_counts_the_engines_time_not_the_routers(
        tiny_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RouterConfig.from_dict({"model": "tiny", "tokenizer": tiny_dir,
                                  "keys": {"block_size": 16}})
    c = Conductor(cfg, Profile(a=0.0, b=0.0, c=ENGINE_S), 1024, StoreView(None, "tiny"))
    e0 = c.registry.add(InstanceSpec(url="http://e0:1", role="both", name="e0"))
    decide = c.decide

    async def slow_decide(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(ROUTER_S)  # e.g. a store lookup that waited on a busy loop
        return await decide(*args, **kwargs)

    monkeypatch.setattr(c, "decide", slow_decide)
    app = build_app("tiny", PromptTokenizer(tiny_dir), [1], 64, 16, None,
                    (ENGINE_S, ENGINE_S))
    metrics = RouterMetrics(c)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            proxy = Proxy(c, client, metrics)
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}
            resp = await proxy.handle("/v1/completions", body, [], 8, {})
            assert isinstance(resp, RelayResponse) and resp.status_code == 200
            async for _ in resp.body_iterator:
                pass

    asyncio.run(run())
    # the engine took about what the profile predicts: no correction beyond noise (one
    # observation folding in the router's 0.3 s would make it 1.6, the ratio capped at 4)
    assert 0.8 <= e0.correction < 1.2
    # the TTFT the clients see still counts the router's time
    seen = metrics.registry.get_sample_value("kvc_router_ttft_actual_seconds_sum")
    assert seen is not None and seen >= ROUTER_S
