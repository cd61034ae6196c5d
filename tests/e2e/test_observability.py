"""deploy/observability: rules, alert unit tests, the dashboard, and all of it against a real
Prometheus scraping a real router, a real vLLM CPU engine with the kvcentric connector and
a real local store (through ``kvcentric store exporter``).

The end-to-end test evaluates every target of every dashboard panel and every recording
rule through Prometheus's query API (each must return a series), every alert expression
(each must evaluate), and checks that every metric name the rules and the dashboard use
is one the running components export (``master_*`` names: against a real
``mooncake_master`` instead).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import (
    VllmServer,
    connector_config,
    free_port,
    spawn,
    stop_group,
    wait_http,
)
from tests.helpers.k8s import DEPLOY, pod_containers, relabel_jobs, workloads

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "deploy" / "observability"
RULES = sorted((OBS / "rules").glob("*.yml"))
DASHBOARD = OBS / "grafana" / "kvcentric-dashboard.json"
# metric names of the components (label names, functions and keywords never match these)
NAME_RE = re.compile(r"(?<![\w:])(vllm:[A-Za-z_:]+|kvc_router_\w+|kvcentric_store_\w+|"
                     r"kvcentric:[\w:]+|master_\w+)")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make setup` installs Debian's prometheus")
    return path


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(f"{p['title']} [{t['refId']}]", t["expr"]) for p in panels() for t in p["targets"]]


def rules() -> list[dict[str, Any]]:
    return [r for f in RULES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]


def all_names() -> set[str]:
    exprs = [e for _, e in dashboard_exprs()] + [r["expr"] for r in rules()]
    return {m for e in exprs for m in NAME_RE.findall(e)}


# ---- static checks ----
def test_promtool_accepts_the_rules() -> None:
    out = subprocess.run([_tool("promtool"), "check", "rules", *map(str, RULES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULES)


def test_every_alert_fires_on_its_unit_test() -> None:
    """promtool's rule unit tests: each alert fires on a history that should trigger it
    and stays quiet on one that should not."""
    tests = OBS / "tests" / "alerts-test.yml"
    out = subprocess.run([_tool("promtool"), "test", "rules", str(tests)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", tests.read_text()))
    assert tested == {r["alert"] for r in rules() if "alert" in r}


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    for p in panels():
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip()
    titles = " ".join(p["title"] for p in panels()).lower()
    for topic in ("ttft", "prediction", "by source", "store usage", "bandwidth", "load / save",
                  "decisions", "rejections", "queue", "kv cache usage"):
        assert topic in titles, f"no panel about {topic!r}"


def test_scrape_config_covers_the_manifests() -> None:
    """The relabeling of prometheus.yml, applied to the manifests' pods, yields a job for
    every engine, router, master and exporter, and every job the rules name; the routers
    (whose /metrics is keyed) are scraped by a job of their own, the only one that sends
    the metrics key, and by no other."""
    cfg = yaml.safe_load((OBS / "prometheus.yml").read_text())
    assert sorted(cfg["rule_files"]) == sorted(f"rules/{f.name}" for f in RULES)
    jobs: set[str] = set()
    for path in sorted(DEPLOY.glob("*/rbg.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        for wl in workloads(docs):
            annotated = (wl.template.get("metadata") or {}).get("annotations", {})
            for c in pod_containers(wl.template):
                by_job = {sc["job_name"]: relabel_jobs(sc["relabel_configs"], annotated, c,
                                                       sc["job_name"])
                          for sc in cfg["scrape_configs"]}
                found = [j for got in by_job.values() for j in got]
                if c["name"].startswith(("vllm", "sglang", "router", "master", "store-exp")):
                    assert found, f"{path.name}: {wl.name}/{c['name']} is not scraped"
                keyed = [n for n, got in by_job.items() if got and "authorization" in next(
                    sc for sc in cfg["scrape_configs"] if sc["job_name"] == n)]
                assert keyed == (["kvcentric-router"] if c["name"] == "router" else []), c
                jobs |= set(found)
    assert jobs == {"vllm", "sglang", "kvcentric-router", "mooncake-master", "kvcentric-store"}
    named = {j for r in rules() for j in re.findall(r'job=~?"([^"]+)"', r["expr"])}
    for pattern in named:
        assert all(j in jobs for j in pattern.split("|")), pattern


def _samples(text: str, store: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels == {"store": store} and not s.name.endswith("_created")}


def test_store_exporter_follows_its_store(store_cfg: StoreConfig, tmp_path: Path) -> None:
    """`kvcentric store exporter` serves the store's stats, and kvcentric_store_up 0 (not a
    failed scrape, not a restarted coordinator) once the coordinator is gone."""
    from kvcentric.store import open_store

    open_store(store_cfg).close()  # starts its coordinator
    port = free_port()
    proc = spawn([sys.executable, "-m", "kvcentric.cli", "store", "exporter", "--name",
                   store_cfg.name, "--runtime-dir", str(store_cfg.local.runtime_dir), "--port",
                   str(port)], tmp_path / "exporter.log")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_http(url, proc, tmp_path / "exporter.log", 30)
        got = _samples(httpx.get(url).text, store_cfg.name)
        assert got["kvcentric_store_up"] == 1.0
        assert got["kvcentric_store_capacity_bytes"] == 64 << 20
        assert got["kvcentric_store_hits_total"] == 0.0
        assert "# TYPE kvcentric_store_hits_total counter" in httpx.get(url).text
        launcher.stop(store_cfg)
        assert _samples(httpx.get(url).text, store_cfg.name) == {"kvcentric_store_up": 0.0}
        assert not launcher.is_running(store_cfg)
    finally:
        stop_group(proc, 10)


@pytest.mark.mooncake
def test_mooncake_names_exist_on_a_real_master(mooncake_ns: Any, tmp_path: Path) -> None:
    from kvcentric.store.mooncake.service import master_command, wait_master

    names = {n for n in all_names() if n.startswith("master_")}
    assert names, "the rules should read the Mooncake master's pool size"
    cmd = master_command("127.0.0.1", 50151, 9103, 0)
    proc = spawn(mooncake_ns.wrap(cmd), tmp_path / "m.log")
    try:
        with mooncake_ns.entered():
            wait_master("127.0.0.1", 50151, 9103, proc=proc)
            text = httpx.get("http://127.0.0.1:9103/metrics", timeout=10).text
    finally:
        stop_group(proc, 10)
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                if line and line[0] != "#"}
    assert names <= exported, names - exported


# ---- against a real Prometheus ----
class Stack:
    def __init__(self, prom: str, router: str, engine: VllmServer) -> None:
        self.prom, self.router, self.engine = prom, router, engine

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(self.prom + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return list(body["data"]["result"])


def _prometheus_config(tmp: Path, targets: dict[str, str]) -> Path:
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(f) for f in RULES],
           "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                              for job, t in targets.items()]}
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _traffic(s: Stack) -> None:
    """Streamed requests (measured TTFT), a store hit after the engine forgot its own
    cache, and one request while the router has no instance (a rejection)."""
    prompts = [[10 + (i * 31 + k) % 3000 for i in range(300)] for k in range(3)]
    for i, p in enumerate(prompts + prompts[:1]):
        if i == len(prompts):
            s.engine.reset_prefix_cache()  # the repeat must come from the store
        body = {"model": "tiny", "prompt": p, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", s.router + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            r.read()
    spec = httpx.get(s.router + "/instances").json()["instances"][0]
    httpx.delete(f"{s.router}/instances/{spec['name']}").raise_for_status()
    r = httpx.post(s.router + "/v1/completions", json={"model": "tiny", "prompt": prompts[0],
                                                       "max_tokens": 1}, timeout=30)
    assert r.status_code == 503
    httpx.post(s.router + "/instances", json={"url": s.engine.url, "role": "both",
                                              "name": spec["name"]}).raise_for_status()


@pytest.fixture(scope="module")
def stack(runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus = _tool("prometheus")
    model = str(build_model("tiny", ROOT / ".models" / "tiny"))
    tmp = tmp_path_factory.mktemp("obs")
    store = {"name": f"obs-{uuid.uuid4().hex[:8]}", "capacity": "256mb",
             "runtime_dir": str(runtime_dir)}
    engine = VllmServer(model, kv_transfer=connector_config(store), log_path=tmp / "vllm.log")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engine.start().wait_ready()
        ports = {k: free_port() for k in ("router", "exporter", "prom")}
        rcfg = {"model": "tiny", "tokenizer": model, "listen": {"port": ports["router"]},
                "instances": [{"url": engine.url, "role": "both", "name": "e0"}],
                "slo": {"ttft_ms": 60000, "tbt_ms": 10000}, "store": store,
                "health": {"interval_s": 0.5, "timeout_s": 2, "unhealthy_after": 2}}
        (tmp / "router.yaml").write_text(yaml.safe_dump(rcfg))
        router = f"http://127.0.0.1:{ports['router']}"
        procs.append(spawn([sys.executable, "-m", "kvcentric.router.cli", "serve",
                             "--config", str(tmp / "router.yaml")], tmp / "router.log"))
        procs.append(spawn([sys.executable, "-m", "kvcentric.cli", "store", "exporter",
                             "--name", store["name"], "--runtime-dir", str(runtime_dir),
                             "--port", str(ports["exporter"])], tmp / "exporter.log"))
        pcfg = _prometheus_config(tmp, {"vllm": engine.url[7:], "kvcentric-router":
                                        router[7:], "kvcentric-store":
                                        f"127.0.0.1:{ports['exporter']}"})
        prom = f"http://127.0.0.1:{ports['prom']}"
        procs.append(spawn([prometheus, f"--config.file={pcfg}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{ports['prom']}",
                             "--log.level=warn"], tmp / "prometheus.log"))
        wait_http(router + "/health", procs[0], tmp / "router.log")
        wait_http(f"http://127.0.0.1:{ports['exporter']}/metrics", procs[1], tmp / "exporter.log")
        wait_http(prom + "/-/ready", procs[2], tmp / "prometheus.log")
        s = Stack(prom, router, engine)
        _traffic(s)
        yield s
    finally:
        for p in reversed(procs):
            stop_group(p, 20)
        engine.stop()
        launcher.stop(StoreConfig.from_dict(store))


def _settled(s: Stack, timeout: float = 90) -> None:
    """Until Prometheus holds the traffic: the rejection, the store hits, and a first
    evaluation of every recording rule (a ratio over rates needs two scrapes of traffic;
    on a loaded machine that can take several evaluation rounds)."""
    checks = ["kvc_router_rejections_total", "vllm:kvcentric_hit_tokens_total > 0",
              "kvc_router_instance_healthy == 1", "kvcentric:store_used_ratio",
              'rate(kvc_router_decisions_total[1m]) > 0',
              *(r["record"] for r in rules() if "record" in r)]
    deadline = time.monotonic() + timeout
    while not all(s.query(c) for c in checks):
        assert time.monotonic() < deadline, [c for c in checks if not s.query(c)]
        # a rate needs the counter to move between two scrapes: the fixture's traffic may
        # all have landed before the router's first scrape, so keep a trickle going
        httpx.post(s.router + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [7] * 16, "max_tokens": 1})
        time.sleep(1)


@pytest.mark.vllm
def test_every_panel_and_rule_returns_data(stack: Stack) -> None:
    _settled(stack)
    targets = stack.query("up")
    assert {t["metric"]["job"] for t in targets} == {"vllm", "kvcentric-router",
                                                     "kvcentric-store"}
    assert all(t["value"][1] == "1" for t in targets), targets
    empty = [where for where, expr in dashboard_exprs()
             if not stack.query(expr.replace("$__rate_interval", "1m"))]
    assert not empty, f"dashboard targets without data: {empty}"
    records = [r["record"] for r in rules() if "record" in r]
    assert not [r for r in records if not stack.query(r)], "recording rules without data"
    for r in rules():
        if "alert" in r:
            stack.query(r["expr"])  # evaluates (firing or not)
    names = httpx.get(stack.prom + "/api/v1/label/__name__/values", timeout=30).json()["data"]
    missing = {n for n in all_names() if not n.startswith("master_")} - set(names)
    assert not missing, f"metric names no component exports: {sorted(missing)}"
