"""SGLang engines behind the router (issue 47 item 4): instances of kind ``sglang``.

No SGLang server runs on this CPU machine, so the engines are emulated
(``benchmarks.emulator.server --kind sglang``): SGLang's ``/metrics`` names, its KV event
structs (byte for byte: tests/bench/test_emulator_wire.py), its ``/server_info`` and its
disaggregation protocol (a bootstrap room joining a prefill server and a decode server).
The router is the real one, in its own process.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from benchmarks.emulator.launch import EmulatedFleet
from benchmarks.serving.gateways import Gateway
from kvcentric.stored_layout import stored_block_size
from tests.helpers.emulated_fleet import fleet as emulated_fleet
from tests.helpers.emulated_fleet import router
from tests.helpers.waiting import wait_until

PREFILL = 2  # the first two engines are prefill servers, the other two decode servers


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatedFleet, Gateway]]:
    logs = tmp_path_factory.mktemp("sglang-pd")
    with emulated_fleet(logs, 4, kind="sglang", prefill_instances=PREFILL) as f:
        g = router(f, logs, tag="-sglang")
        try:
            g.start()
            g.wait_ready(120)
            yield f, g
        finally:
            g.stop()


def instances(g: Gateway) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in httpx.get(g.url + "/instances", timeout=10).json()["instances"]}


def ask(g: Gateway, prompt: list[int], stream: bool = False,
        salt: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "bench", "prompt": prompt, "max_tokens": 4,
                            "ignore_eos": True, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(g.url + "/v1/completions", json=body, timeout=60)


def test_the_router_reads_sglang_servers_as_sglang(pd: tuple[EmulatedFleet, Gateway]) -> None:
    """Kind, the prefill servers' bootstrap ports (from their /server_info, none
    configured) and each engine's cache size (SGLang's metrics give tokens, its
    /server_info the page)."""
    f, g = pd
    emu = {s["name"]: s for s in f.specs}
    assert wait_until(lambda: all(x["cache_blocks"] != 4096 and x["kind"] == "sglang"
                                  for x in instances(g).values()), 30), instances(g)
    got = instances(g)
    for name, inst in got.items():
        assert inst["role"] == emu[name]["role"]
        info = httpx.get(emu[name]["url"] + "/server_info", timeout=10).json()
        assert inst["bootstrap_port"] == info["disaggregation_bootstrap_port"]
        assert (inst["bootstrap_port"] is not None) == (inst["role"] == "prefill")
        # the emulator's 256 pages, in the router's blocks (its default: 4096 blocks)
        assert info["max_total_num_tokens"] == 256 * info["page_size"]
        assert inst["cache_blocks"] == (info["max_total_num_tokens"]
                                        // stored_block_size(info["page_size"])) != 4096


@pytest.mark.parametrize("stream", [False, True])
def test_a_pair_runs_sglangs_bootstrap_protocol(pd: tuple[EmulatedFleet, Gateway],
                                               stream: bool) -> None:
    """Each request goes to a prefill server and a decode server at once: the decode
    answers with the prompt's KV handed over (all of it but the last token cached), the
    prefill computed it."""
    f, g = pd
    rnd = random.Random(f"pair-{stream}")
    prompt = [rnd.randrange(10, 8000) for _ in range(700)]
    rid = f"pair-{stream}"
    r = httpx.post(g.url + "/v1/completions", timeout=60, headers={"x-request-id": rid},
                   json={"model": "bench", "prompt": prompt, "max_tokens": 4,
                         "ignore_eos": True, "stream": stream,
                         **({"stream_options": {"include_usage": True}} if stream else {})})
    assert r.status_code == 200, r.text
    names = [s["name"] for s in f.specs]
    assert r.headers["x-kvc-prefill"] in names[:PREFILL]
    assert r.headers["x-kvc-decode"] in names[PREFILL:]
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["usage"]["completion_tokens"] == 4
    def recorded() -> list[dict[str, Any]]:
        return [x for x in f.records() if x["request_id"] == rid]

    assert wait_until(lambda: len(recorded()) == 2, 30), recorded()
    recs = recorded()
    by = {x["engine"]: x for x in recs}
    assert set(by) == {r.headers["x-kvc-prefill"], r.headers["x-kvc-decode"]}, recs
    dec, pre = by[r.headers["x-kvc-decode"]], by[r.headers["x-kvc-prefill"]]
    assert pre["max_tokens"] == 1 and pre["prompt_tokens"] == 700
    assert dec["max_tokens"] == 4 and dec["external_hit"] + dec["local_hit"] == 699


def test_a_shared_prefix_stays_on_the_prefill_server_holding_it(
        pd: tuple[EmulatedFleet, Gateway]) -> None:
    """SGLang's KV events (one page each, its own hashes, the salt a field of its own)
    make the prefix resident on the prefill server that computed it: the requests that
    share it go there, and a salted request's blocks are resident only under its salt."""
    f, g = pd
    rnd = random.Random("hot")
    hot = [rnd.randrange(10, 8000) for _ in range(1024)]
    first = ask(g, hot + [rnd.randrange(10, 8000) for _ in range(32)])
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvc-prefill"]
    assert wait_until(lambda: instances(g)[holder]["resident_blocks"] >= 4, 30), \
        instances(g)[holder]
    for _ in range(5):
        r = ask(g, hot + [rnd.randrange(10, 8000) for _ in range(32)])
        assert r.status_code == 200, r.text
        assert r.headers["x-kvc-prefill"] == holder
        assert int(r.headers["x-kvc-hit-tokens"]) >= 1024
    got = instances(g)[holder]
    assert got["kv_event_batches"] > 0 and got["kv_event_gaps"] == 0
    # salted: none of the unsalted blocks are its, its own are once computed
    salted = [ask(g, hot + [rnd.randrange(10, 8000) for _ in range(32)], salt="tenant-a")
              for _ in range(2)]
    assert [r.status_code for r in salted] == [200, 200], salted[0].text
    assert int(salted[0].headers["x-kvc-hit-tokens"]) == 0
    assert int(salted[1].headers["x-kvc-hit-tokens"]) >= 1024


def test_a_decode_without_its_prefill_is_refused_as_sglang_refuses_it(
        pd: tuple[EmulatedFleet, Gateway]) -> None:
    """The emulated decode server checks what SGLang checks: a request with no bootstrap
    room, or naming no prefill server, is a 400 (so the router's bootstrap fields above
    were checked, not ignored)."""
    f, _ = pd
    dec = f.specs[PREFILL]["url"]
    body = {"model": "bench", "prompt": [11, 12, 13], "max_tokens": 2}
    r = httpx.post(dec + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "bootstrap_room" in r.text
    r = httpx.post(dec + "/v1/completions", timeout=30, json={
        **body, "bootstrap_room": 7, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1})
    assert r.status_code == 400 and "prefill server" in r.text
