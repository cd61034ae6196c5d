"""The router end to end: real vLLM CPU servers (tiny model, float32), a real local store,
the router as its own process (``python -m router.cli serve``) over real HTTP, its cost
profile measured by ``router.cli profile`` on one of the servers.

Servers: ``a`` and ``b`` (kv_both, publishing KV events to the router), ``p``
(kv_producer) and ``d`` (kv_consumer), all on one store. Tests swap the router's
instances through its admin API. The last test kills ``b``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from benchmarks.serving.dashboard_screenshot import (
    PNG_MAGIC,
    chromium_path,
    dump_dom,
    record,
    screenshot,
)
from kvcentric.config import StoreConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.store import OK, open_store
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import (
    VllmServer,
    connector_config,
    free_port,
    spawn,
    wait_http,
)
from tests.helpers.dashboard import check, read_page, scrape
from tests.helpers.e2e_store import e2e_store
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.vllm
SLO_TTFT_MS = 1500
BLOCK = 128  # the connector's default stored block on vLLM CPU (= the engine page)
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega river stone cloud forest ember").split()


@dataclass
class Cluster:
    servers: dict[str, VllmServer]
    events: dict[str, str]
    replay: dict[str, str]
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    store: dict[str, Any]
    config: Path

    def spec(self, name: str, role: str) -> dict[str, Any]:
        s: dict[str, Any] = {"url": self.servers[name].url, "role": role, "name": name}
        if name in self.events:
            s["kv_events"] = self.events[name]
            s["kv_events_replay"] = self.replay[name]
        return s

    def kill_router(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def start_router(self, config: Path | None = None) -> None:
        """Start the router (its own config, or ``config``: same port) and wait for it."""
        self.proc = start_router(config or self.config, self.log)
        wait_http(self.url + "/health", self.proc, self.log, 60)

    def use(self, **roles: str) -> None:
        """Make the router's instances exactly ``name=role, ...``."""
        cur = httpx.get(self.url + "/instances").json()["instances"]
        for i in cur:
            httpx.delete(f"{self.url}/instances/{i['name']}").raise_for_status()
        for name, role in roles.items():
            httpx.post(self.url + "/instances", json=self.spec(name, role)).raise_for_status()

    def instances(self) -> dict[str, dict[str, Any]]:
        return {i["name"]: i for i in httpx.get(self.url + "/instances").json()["instances"]}


def hits(srv: VllmServer, external: bool = False) -> float:
    key = "vllm:external_prefix_cache_hits_total" if external else \
        "vllm:prefix_cache_hits_total"
    return srv.metrics().get(key, 0.0)


def text(seed: int, words: int = 250) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def token_prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


def _events_cfg(endpoint: str, replay: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"})


def start_router(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return spawn([sys.executable, "-m", "kvcentric.router.cli", "serve", "--config",
                  str(config), "--log-level", "debug"], log)


@pytest.fixture(scope="module")
def cluster(runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    tmp = tmp_path_factory.mktemp("router-e2e")
    store = e2e_store("router-e2e", "512mb", runtime_dir)
    ev = {n: f"tcp://127.0.0.1:{free_port()}" for n in "ab"}
    rp = {n: f"tcp://127.0.0.1:{free_port()}" for n in "ab"}  # the engines' replay buffers
    roles = {"a": "kv_both", "b": "kv_both", "p": "kv_producer", "d": "kv_consumer"}
    servers = {n: VllmServer(model, log_path=tmp / f"{n}.log",
                             kv_transfer=connector_config(store, role=r),
                             args=["--kv-events-config", _events_cfg(ev[n], rp[n])]
                             if n in ev else ())
               for n, r in roles.items()}
    proc = None
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
        profile = tmp / "profile.json"
        subprocess.run([sys.executable, "-m", "kvcentric.router.cli", "profile",
                        "--url", servers["a"].url, "--model", "tiny", "--out", str(profile),
                        "--lengths", "256,1024,2048",
                        "--hits", "0,0.5", "--repeats", "1"], check=True, timeout=300)
        port = free_port()
        cfg = {"model": "tiny", "tokenizer": model, "listen": {"port": port},
               "instances": [{"url": servers[n].url, "role": "both", "name": n,
                              "kv_events": ev[n], "kv_events_replay": rp[n]}
                             for n in ("a", "b")],
               "slo": {"ttft_ms": SLO_TTFT_MS, "tbt_ms": 1000}, "store": store,
               "cost": {"profile": str(profile), "store_bandwidth_gbps": 1.0,
                        "correct_with_actual": False},
               "health": {"interval_s": 0.5, "timeout_s": 2, "unhealthy_after": 2},
               "upstream": {"timeout_s": 120}}
        (tmp / "router.yaml").write_text(yaml.safe_dump(cfg))
        log = tmp / "router.log"
        proc = start_router(tmp / "router.yaml", log)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc, log, 60)
        cluster = Cluster(servers, ev, rp, url, proc, log, store, tmp / "router.yaml")
        yield cluster
        proc = cluster.proc  # the router a test restarted last
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        for s in servers.values():
            s.stop()
        launcher.stop(StoreConfig.from_dict(store))


def chat(url: str, messages: list[dict[str, str]]) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0})
    r.raise_for_status()
    return r


def test_multi_turn_lands_where_its_prefix_is_cheapest(cluster: Cluster) -> None:
    c, srv = cluster, cluster.servers
    convs = {1: [{"role": "user", "content": text(1)}], 2: [{"role": "user", "content": text(2)}]}
    last = {1: chat(c.url, convs[1])}
    home = {1: last[1].headers["x-kvc-prefill"]}
    home[2] = "b" if home[1] == "a" else "a"
    # conversation 2 starts on the other instance behind the router's back: the router can
    # only learn that its prefix lives there from that engine's KV events
    last[2] = chat(srv[home[2]].url, convs[2])
    deadline = time.monotonic() + 10
    while c.instances()[home[2]]["resident_blocks"] == 0:
        assert time.monotonic() < deadline, "no KV events from the engine"
        time.sleep(0.2)
    assert c.instances()[home[2]]["residency"] == "kv_events"
    for k, seed in ((1, 3), (2, 4), (1, 5)):
        answer = last[k].json()["choices"][0]["message"]["content"]
        convs[k] += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": text(seed, 60)}]
        before = hits(srv[home[k]])
        last[k] = chat(c.url, convs[k])
        assert last[k].headers["x-kvc-prefill"] == home[k], (k, last[k].headers)
        hit = int(last[k].headers["x-kvc-hit-tokens"])
        assert hit >= 2 * BLOCK
        assert hits(srv[home[k]]) - before >= hit  # the engine really reused that much


def _complete(url: str, prompt: list[int], stream: bool, **extra: Any) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return list(r.json()["choices"][0]["token_ids"])
    out: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return out


def test_prefill_decode_pair_matches_a_single_instance(cluster: Cluster) -> None:
    c, srv = cluster, cluster.servers
    c.use(p="prefill", d="decode")
    try:
        for i, stream in enumerate((False, True)):
            prompt = token_prompt(10 + i, 1100)
            # a fresh salt: the reference computes everything itself, no store, no cache
            want = _complete(srv["a"].url, prompt, False, cache_salt=f"ref-{i}")
            before = hits(srv["d"], external=True)
            got = _complete(c.url, prompt, stream)
            assert got == want and len(got) == 24
            # d loads all but the last prompt token (blocks and tail) and computes that one
            assert hits(srv["d"], external=True) - before == 1100 - 1
        m = httpx.get(c.url + "/metrics").text
        assert 'kvc_router_decisions_total{decode="d",prefill="p"} 2.0' in m
    finally:
        c.use(a="both", b="both")
    # neither a nor b ever computed that prompt (a only a salted copy), but the store holds
    # it: the router counts it as a hit on either, and the engine it picks loads exactly that
    # much from the store
    before = {n: hits(srv[n], external=True) for n in ("a", "b")}
    r = httpx.post(c.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": token_prompt(10, 1100), "max_tokens": 4})
    hit = int(r.headers["x-kvc-hit-tokens"])
    assert hit == 1100 - 1  # the router knows the store holds the tail too
    chosen = r.headers["x-kvc-prefill"]
    assert hits(srv[chosen], external=True) - before[chosen] == hit
    keys = httpx.get(c.url + "/instances").json()["keys"]
    assert keys["block_size"] == BLOCK and keys["layout_sig"]


def test_pd_handoff_survives_store_eviction_pressure(cluster: Cluster) -> None:
    """The prefill's blocks are soft-pinned until the decode reads them: a flood of other
    objects (1.5x the store) between the prefill and the decode evicts everything else,
    and the decode still loads the whole prompt instead of recomputing it."""
    srv = cluster.servers
    prompt = token_prompt(31, 1100)
    httpx.post(srv["p"].url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1}).raise_for_status()
    junk = np.full(4 << 20, 3, np.uint8)
    with open_store(cluster.store) as st:
        codes = [st.batch_put_from([f"flood-{i}"], [junk.ctypes.data], [junk.nbytes])[0]
                 for i in range(192)]  # 768 MiB through a 512 MiB store
        assert codes.count(OK) >= 100
    before = hits(srv["d"], external=True)
    _complete(srv["d"].url, prompt, False)
    assert hits(srv["d"], external=True) - before == len(prompt) - 1


def test_overload_is_refused_with_429_not_timeouts(cluster: Cluster) -> None:
    c = cluster

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float, str]:
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": token_prompt(1000 + i, 3000), "max_tokens": 4})
        return r.status_code, time.perf_counter() - t0, r.headers.get("retry-after", "")

    # enough prompts that the router's own profile predicts twice the SLO of queue on each
    # of the two instances (a fast profile, fitted on an idle machine, must still see it)
    prefill_s = Profile.load(c.config.parent / "profile.json").prefill_s(3000)
    n = min(256, max(64, math.ceil(2 * 2 * SLO_TTFT_MS / 1000 / prefill_s) + 4))

    async def burst() -> list[tuple[int, float, str]]:
        async with httpx.AsyncClient(base_url=c.url, timeout=120,
                                     limits=httpx.Limits(max_connections=300)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    t0 = time.perf_counter()
    res = asyncio.run(burst())
    codes = [r[0] for r in res]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 2
    assert all(int(ra) >= 1 for code, _, ra in res if code == 429)
    assert max(t for code, t, _ in res if code == 429) < 10  # refused at once
    assert time.perf_counter() - t0 < 110
    m = httpx.get(c.url + "/metrics").text
    assert 'kvc_router_rejections_total{reason="ttft"}' in m


@contextlib.contextmanager
def keyed_router(c: Cluster, tmp: Path, keys: dict[str, str], admin: str) -> Iterator[str]:
    """A second router on the cluster's store with API keys (no KV events: the first
    router holds those sockets); yields its URL, stops it after."""
    cfg = yaml.safe_load((c.log.parent / "router.yaml").read_text())
    port = free_port()
    cfg.update(listen={"port": port}, instances=[], auth={"api_keys": keys, "admin_key": admin})
    (tmp / "keyed.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp / "keyed.log"
    proc = spawn([sys.executable, "-m", "kvcentric.router.cli", "serve", "--config",
                  str(tmp / "keyed.yaml")], log)
    try:
        wait_http(f"http://127.0.0.1:{port}/openapi.json", proc, log, 60)  # /metrics is keyed
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_tenants_never_share_kv_but_share_within_a_tenant(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    c, srv = cluster, cluster.servers
    keys = {"sk-tenant-a-01": "team-a", "sk-tenant-b-01": "team-b"}
    admin = {"Authorization": "Bearer sk-admin-0001"}
    key = {t: {"Authorization": f"Bearer {k}"} for k, t in keys.items()}
    prompt = token_prompt(77, 700)

    def complete(url: str, tenant: str | None) -> httpx.Response:
        return httpx.post(url + "/v1/completions", timeout=120,
                          headers=key[tenant] if tenant else {},
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 2})

    def only(url: str, name: str) -> None:
        for i in httpx.get(url + "/instances", headers=admin).json()["instances"]:
            httpx.delete(f"{url}/instances/{i['name']}", headers=admin).raise_for_status()
        httpx.post(url + "/instances", headers=admin,
                   json={"url": srv[name].url, "role": "both", "name": name}).raise_for_status()

    with keyed_router(c, tmp_path, keys, "sk-admin-0001") as url:
        assert complete(url, None).status_code == 401
        assert httpx.get(url + "/instances", headers=key["team-a"]).status_code == 403
        only(url, "a")
        complete(url, "team-a").raise_for_status()  # a computes it and saves it, salted
        only(url, "b")
        ext, local = hits(srv["b"], external=True), hits(srv["b"])
        complete(url, "team-b").raise_for_status()  # same prompt, other tenant: nothing
        assert hits(srv["b"], external=True) == ext and hits(srv["b"]) == local
        complete(url, "team-a").raise_for_status()  # same tenant on b: from the store
        assert hits(srv["b"], external=True) - ext >= 5 * BLOCK


def _homes(url: str, prompts: list[list[int]]) -> list[str]:
    """The prefill instance the router picks for each prompt, one after the other."""
    out = []
    for p in prompts:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0.0})
        r.raise_for_status()
        out.append(r.headers["x-kvc-prefill"])
    return out


def test_a_restarted_router_routes_by_prefix_at_once(cluster: Cluster) -> None:
    """SIGKILL the router mid-run and restart it: replaying the engines' event buffers, it
    sends every conversation back to the engine holding its prefix within seconds. The
    same restart without the replay routes blind (the control: the test can fail)."""
    c, srv = cluster, cluster.servers
    c.use(a="both", b="both")
    prompts = [token_prompt(900 + i, 3 * BLOCK + 17) for i in range(8)]
    homes = ["ab"[i % 2] for i in range(8)]
    before = {n: i["resident_blocks"] for n, i in c.instances().items()}
    for p, home in zip(prompts, homes):  # behind the router's back: only events tell it
        _complete(srv[home].url, p, False)

    def settled() -> bool:
        """Each engine's events for its four prompts (three full blocks each) are in, and
        its load as last read from /metrics is nil: a read taken while it served one of
        them would make it look busy, and the router would rightly send its prefix
        elsewhere."""
        inst = c.instances()
        return all(i["resident_blocks"] >= before[n] + 4 * 3 and i["running"] == 0
                   and i["waiting"] == 0 for n, i in inst.items())
    assert wait_until(settled, 30), c.instances()
    follow = [p + token_prompt(950 + i, 40) for i, p in enumerate(prompts)]
    assert _homes(c.url, follow[:2]) == homes[:2]  # before the kill: by prefix
    blind = c.config.with_name("router-no-replay.yaml")
    raw = yaml.safe_load(c.config.read_text())
    for inst in raw["instances"]:
        inst.pop("kv_events_replay")
    blind.write_text(yaml.safe_dump(raw))
    try:
        c.kill_router()
        c.start_router(blind)
        assert _homes(c.url, follow[4:]) != homes[4:]  # no residency: ties go one way
        c.kill_router()
        t0 = time.monotonic()
        c.start_router()
        ready = time.monotonic() - t0
        got = _homes(c.url, follow[:4])
        routed = time.monotonic() - t0
    finally:
        if c.proc.poll() is not None:
            c.start_router()
    assert got == homes[:4], (got, homes)
    inst = c.instances()
    assert all(inst[n]["kv_event_batches_replayed"] > 0 for n in "ab"), inst
    assert routed - ready <= 10.0, (ready, routed)
    print(f"router restart: ready in {ready:.1f} s, prefix routing back after {routed:.1f} s")


def test_dashboard_shows_what_metrics_says(cluster: Cluster, tmp_path: Path) -> None:
    """The live page, rendered by headless Chromium over real traffic, shows the numbers
    /metrics gives (tests/helpers/dashboard.py: counts exactly, the rest to the precision
    shown). ``KVC_DASHBOARD_SCREENSHOT=PATH.json`` also records it there (the committed
    benchmarks/results/dashboard.json and its dashboard_page.png)."""
    if chromium_path() is None:
        pytest.skip("chromium is not installed (make setup installs it)")
    c = cluster
    c.use(a="both", b="both")
    for i in range(6):  # each prompt twice: the second lands where its prefix is
        _complete(c.url, token_prompt(600 + i % 3, 2 * BLOCK + 40), stream=i % 2 == 1)
    chat(c.url, [{"role": "user", "content": text(6)}])
    reads: list[dict[str, int]] = []

    def settled() -> bool:
        """KV events trail the answers: the router has them (blocks resident) and two
        reads half a second apart agree; the page and /metrics are compared only then."""
        reads.append({n: i["resident_blocks"] for n, i in c.instances().items()})
        return len(reads) >= 2 and reads[-1] == reads[-2] and sum(reads[-1].values()) > 0

    assert wait_until(settled, 30, interval=0.5), f"residency never settled: {reads[-3:]}"
    page = read_page(dump_dom(c.url + "/dashboard"))
    samples = scrape(httpx.get(c.url + "/metrics").text)  # no request in between
    check(page, samples)
    assert [r[:3] for r in page.rows["instances"]] == [["a", "both", "up"],
                                                       ["b", "both", "up"]]
    assert samples["kvc_router_ttft_actual_seconds_count"] >= 3
    assert samples["kvc_router_predicted_hit_tokens_by_tier_total{tier=engine}"] >= 2 * BLOCK
    png = screenshot(c.url + "/dashboard", tmp_path / "dashboard.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    if os.environ.get("KVC_DASHBOARD_SCREENSHOT"):
        record(c.url, Path(os.environ["KVC_DASHBOARD_SCREENSHOT"]),
               command="KVC_DASHBOARD_SCREENSHOT=benchmarks/results/dashboard.json "
               "python -m pytest tests/e2e/test_router_e2e.py -k dashboard")


def test_killing_an_instance_mid_run_keeps_requests_succeeding(cluster: Cluster) -> None:
    c, srv = cluster, cluster.servers

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=c.url, timeout=120) as client:
            codes: list[int] = []
            for wave in range(8):
                if wave == 2:
                    os.killpg(os.getpgid(srv["b"].proc.pid), signal.SIGKILL)  # type: ignore
                rs = await asyncio.gather(*(client.post("/v1/completions", json={
                    "model": "tiny", "prompt": token_prompt(5000 + wave * 10 + k, 400),
                    "max_tokens": 4}) for k in range(3)))
                codes += [r.status_code for r in rs]
            return codes

    codes = asyncio.run(run())
    assert codes == [200] * 24
    inst = c.instances()
    assert inst["b"]["healthy"] is False and inst["a"]["healthy"] is True
