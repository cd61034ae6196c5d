"""deploy/kubernetes, offline: every manifest against the Kubernetes schemas
(``kubernetes-validate``, strict: unknown fields are errors), the RoleBasedGroup structure,
and the cross-references a cluster would only reveal at run time: probes and listen flags
on declared ports, binds on the pod IP or loopback, every address in env and in the
router config resolving to a workload and port, the engines' and router's configs parsed
by kvcentric's own parsers, command lines parsed by the real CLIs (kvcentric, the router,
vLLM, SGLang), plain manifests equal to the RBG ones, the Dockerfile's inputs, and in every
Mooncake manifest NetworkPolicies that let only the group's engines, router and storage
nodes reach the master and the storage nodes.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from kvcentric.compat import TESTED_SGLANG, TESTED_VLLM
from kvcentric.config import StoreConfig, parse_size
from tests.helpers.k8s import (
    DEPLOY,
    POD_IP,
    RBG_API,
    ROOT,
    SECRET,
    Workload,
    argv,
    env,
    flag,
    pod_containers,
    ports,
    unresolved,
    workloads,
)

K8S_VERSION = "1.29.0"  # native sidecars (the single-node store) are on by default from 1.29
MANIFESTS = sorted(DEPLOY.glob("*/*.yaml"))
VARIANTS = sorted(p.name for p in DEPLOY.iterdir() if p.is_dir())
ROLE_KEYS = {"name", "labels", "annotations", "replicas", "rolloutStrategy", "restartPolicy",
             "dependencies", "workload", "template", "templateRef", "templatePatch",
             "leaderWorkerSet", "components", "servicePorts", "engineRuntimes",
             "scalingAdapter", "minReadySeconds"}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def containers(docs: list[dict[str, Any]]) -> list[tuple[Workload, dict[str, Any]]]:
    return [(wl, c) for wl in workloads(docs) for c in pod_containers(wl.template)]


def engines(docs: list[dict[str, Any]]) -> list[tuple[Workload, dict[str, Any], list[str]]]:
    out = []
    for wl, c in containers(docs):
        words = argv(c)
        if "vllm.entrypoints.openai.api_server" in words or "sglang.launch_server" in words:
            out.append((wl, c, words))
    return out


def routers(docs: list[dict[str, Any]]) -> list[tuple[Workload, dict[str, Any], list[str]]]:
    return [(wl, c, argv(c)) for wl, c in containers(docs) if argv(c)[0] == "kvcentric-router"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_schemas(path: Path) -> None:
    """Core objects strictly against Kubernetes' schemas; each RBG role's pod template as
    a PodTemplate; the RBG's own structure (roles, names, dependencies) minimally."""
    for doc in load(path):
        if doc["apiVersion"] != RBG_API:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            continue
        assert doc["kind"] == "RoleBasedGroup" and set(doc["spec"]) <= {
            "roles", "roleTemplates", "podGroupPolicy", "coordination"}
        roles = doc["spec"]["roles"]
        names = [r["name"] for r in roles]
        assert roles and len(set(names)) == len(names)
        for r in roles:
            assert set(r) <= ROLE_KEYS, set(r) - ROLE_KEYS
            assert DNS_LABEL.fullmatch(r["name"]) and len(r["name"]) <= 63
            assert isinstance(r["replicas"], int) and r["replicas"] >= 0
            assert len(f"s-{doc['metadata']['name']}-{r['name']}") <= 63
            assert set(r.get("dependencies", [])) <= set(names) - {r["name"]}
            assert r.get("workload", {}).get("kind", "StatefulSet") == "StatefulSet"
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": r["name"]},
                                          "template": r["template"]}, K8S_VERSION, strict=True)
        order = {r["name"]: set(r.get("dependencies", [])) for r in roles}
        while order:  # dependencies form no cycle
            ready = [n for n, deps in order.items() if not deps & set(order)]
            assert ready, f"dependency cycle among {sorted(order)}"
            for n in ready:
                del order[n]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_ports_probes_and_binds(path: Path) -> None:
    """Probes target declared ports; the ports a container declares are exactly those its
    command listens on; everything binds the pod IP or loopback; no $(VAR) stays literal."""
    for wl, c in containers(load(path)):
        where = f"{wl.name}/{c['name']}"
        declared = ports(c)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe, {})
            port = (p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
            if port is not None:
                assert port in declared or port in declared.values(), f"{where} {probe}"
        words = argv(c)
        listens = {int(v) for f in ("--port", "--metrics-port", "--metadata-port")
                   if (v := flag(words, f)) is not None}
        assert set(declared.values()) == listens, where
        for f in ("--host", "--hostname"):
            if (host := flag(words, f)) is not None:
                assert host in (POD_IP, "127.0.0.1"), f"{where} binds {host}"
        assert not unresolved(c), f"{where}: {unresolved(c)}"


def _resolve(docs: list[dict[str, Any]], host: str, port: int) -> tuple[Workload, str]:
    """The workload and port name behind ``host:port`` (pod DNS or a Service)."""
    for wl in workloads(docs):
        if host in wl.hosts():
            for c in pod_containers(wl.template):
                names = {v: k for k, v in ports(c).items()}
                if port in names:
                    return wl, names[port]
    raise AssertionError(f"{host}:{port} is no workload's port")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_services_and_mooncake_addresses(path: Path) -> None:
    """Services select pods and target their ports; headless Services exist for every
    StatefulSet; MOONCAKE_* env names the master's rpc and metadata ports and parses."""
    from kvcentric.store.mooncake.config import MooncakeSettings

    docs = load(path)
    wls = list(workloads(docs))
    for svc in by_kind(docs, "Service").values():
        sel = svc["spec"]["selector"]
        chosen = [wl for wl in wls if sel.items() <= wl.labels.items()]
        assert chosen, f"Service {svc['metadata']['name']} selects no pod"
        for p in svc["spec"]["ports"]:
            assert any(p["targetPort"] in {**ports(c), **{v: v for v in ports(c).values()}}
                       for wl in chosen for c in pod_containers(wl.template))
    for wl in wls:
        if wl.kind == "StatefulSet":
            svc = by_kind(docs, "Service")[wl.service or ""]
            assert svc["spec"]["clusterIP"] == "None"
    for _, c in containers(docs):
        e = env(c)
        if "MOONCAKE_MASTER" not in e:
            continue
        host, port = e["MOONCAKE_MASTER"].rsplit(":", 1)
        master, name = _resolve(docs, host, int(port))
        assert (master.role, name) == ("mooncake-master", "rpc")
        meta = urlparse(e["MOONCAKE_TE_META_DATA_SERVER"])
        assert _resolve(docs, meta.hostname or "", meta.port or 80) == (master, "metadata")
        settings = MooncakeSettings.load({}, env=e)
        assert settings.local_hostname in (POD_IP, "127.0.0.1")
        if argv(c)[:3] == ["kvcentric", "store", "mooncake-node"]:
            limit = c["resources"]["limits"]["memory"]
            assert parse_size(limit.replace("Gi", "gb")) > settings.global_segment_size
        else:
            assert settings.global_segment_size == 0, "engines and router are pure clients"


def _store(words: list[str]) -> tuple[StoreConfig, Any]:
    """The store config and settings object of an engine command line."""
    from kvcentric.connector.sglang.settings import SGLangSettings
    from kvcentric.connector.vllm.settings import ConnectorSettings

    if (kv := flag(words, "--kv-transfer-config")) is not None:
        cfg = json.loads(kv)
        assert cfg["kv_connector"] == "KVCentricConnector"
        s: Any = ConnectorSettings.from_extra_config(cfg["kv_connector_extra_config"])
        return s.store, cfg
    extra = json.loads(flag(words, "--hicache-storage-backend-extra-config") or "{}")
    assert extra["module_path"] == "kvcentric.connector.sglang"
    s = SGLangSettings.from_extra_config(extra)
    assert s.model_id == flag(words, "--served-model-name")
    return s.store, extra


def _memory_mount(template: Any, container: Any, path: Path) -> int:
    """sizeLimit of the Memory emptyDir ``container`` mounts above ``path``."""
    vols = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        vol = vols[m["name"]]
        if path.is_relative_to(m["mountPath"]) and vol.get("emptyDir", {}).get("medium") == \
                "Memory":
            return parse_size(vol["emptyDir"]["sizeLimit"].replace("Gi", "gb"))
    raise AssertionError(f"{container['name']}: {path} is not on a memory-backed emptyDir")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_engine_and_store_configs(path: Path) -> None:
    """Connector configs parse; a local store lives on /dev/shm backed by memory, its
    capacity below the emptyDir's size (the doctor's shm check, at deploy time)."""
    docs = load(path)
    found = engines(docs)
    assert found
    for wl, c, words in found:
        store, _ = _store(words)
        if store.backend == "local":
            _memory_mount(wl.template, c, store.local.runtime_dir)
            assert not store.local.autostart, "the store sidecar owns the coordinator"
    for wl, c in containers(docs):
        words = argv(c)
        if words[:3] == ["kvcentric", "store", "serve"]:
            run_dir = Path(flag(words, "--runtime-dir") or "/dev/shm")
            size = _memory_mount(wl.template, c, run_dir)
            assert parse_size(flag(words, "--capacity") or "4gb") < size


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_router_config_matches_engines(path: Path) -> None:
    """The router config parses; each instance URL is an engine pod's port, its role the
    engine's kv_role, every engine replica listed once; same model and store."""
    from kvcentric.router.config import RouterConfig

    docs = load(path)
    for wl, c, words in routers(docs):
        conf = Path(flag(words, "--config") or "")
        vols = {v["name"]: v for v in wl.template["spec"]["volumes"]}
        mount = next(m for m in c["volumeMounts"] if conf.parent == Path(m["mountPath"])
                     or (conf.name == "router.yaml" and m["mountPath"] == "/etc/kvcentric"))
        cm = by_kind(docs, "ConfigMap")[vols[mount["name"]]["configMap"]["name"]]
        raw = yaml.safe_load(cm["data"]["router.yaml"].replace("__POD_IP__", POD_IP))
        cfg = RouterConfig.from_dict(raw)
        assert any(Path(cfg.tokenizer).is_relative_to(m["mountPath"])
                   for m in c["volumeMounts"]), "the router needs the tokenizer"
        listed = []
        for inst in cfg.instances:
            url = urlparse(inst.url)
            host = url.hostname or ""
            engine = next((e for e in engines(docs) if int(flag(e[2], "--port") or 0) ==
                           url.port and (host == POD_IP or host in e[0].hosts())), None)
            assert engine is not None, f"{inst.url} is no engine's port"
            store, kv = _store(engine[2])
            assert kv["kv_role"] == KV_ROLES[inst.role], inst.url
            assert flag(engine[2], "--served-model-name") == cfg.model
            assert cfg.store is not None
            assert (cfg.store.backend, cfg.store.name) == (store.backend, store.name)
            if store.backend == "local":  # the same coordinator: its runtime dir
                assert cfg.store.local.runtime_dir == store.local.runtime_dir
            else:  # the same Mooncake cluster: its master
                assert (cfg.store.mooncake.master_server_address
                        == store.mooncake.master_server_address)
            listed.append(host if host != POD_IP else f"{POD_IP}:{url.port}")
        expected = []
        for ewl, _, ewords in engines(docs):
            if ewl.name == wl.name:  # engines in the router's own pod
                expected.append(f"{POD_IP}:{flag(ewords, '--port')}")
            else:
                expected += [h for h in ewl.hosts() if h != ewl.service]
        assert sorted(listed) == sorted(expected), "router instances != engine replicas"


def test_secrets_and_configmaps_exist() -> None:
    """Every Secret and ConfigMap referenced exists; engines take their API key, and the
    router its (future) key, from a Secret."""
    for path in MANIFESTS:
        docs = load(path)
        secrets = by_kind(docs, "Secret")
        for _, c in containers(docs):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], path
        for wl in workloads(docs):
            for v in wl.template["spec"].get("volumes", []):
                if "configMap" in v:
                    assert v["configMap"]["name"] in by_kind(docs, "ConfigMap"), path
        for _, c, words in engines(docs):
            key = env(c).get("VLLM_API_KEY") if "vllm" in c["name"] else flag(words,
                                                                               "--api-key")
            assert key == SECRET, f"{path}: {c['name']} takes no API key from a Secret"
        for _, c, _ in routers(docs):  # tenant, admin, metrics keys, salt secret, engines' key
            for name in ("KVCENTRIC_ROUTER_API_KEYS", "KVCENTRIC_ROUTER_ADMIN_KEY",
                         "KVCENTRIC_ROUTER_METRICS_KEY", "KVCENTRIC_ROUTER_SALT_SECRET",
                         "KVCENTRIC_ROUTER_UPSTREAM_API_KEY"):
                assert env(c).get(name) == SECRET, (path, name)


def _router_flags() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "kvcentric.router.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return set(re.findall(r"(--[a-z-]+)", out))


def test_command_lines_parse_with_the_real_clis() -> None:
    """kvcentric and kvcentric-router flags exist; vLLM's and SGLang's own parsers accept
    the engine command lines (skipped for an engine that is not installed)."""
    from kvcentric.cli import build_parser

    router_flags = _router_flags()
    vllm_lines, sglang_lines = [], []
    for path in MANIFESTS:
        for _, c in containers(load(path)):
            words = argv(c)
            probe = c.get("startupProbe", {}).get("exec", {}).get("command")
            for line in (words, probe or []):
                if line[:1] == ["kvcentric"]:
                    args = build_parser().parse_args(line[1:])  # SystemExit on a bad flag
                    assert args.cmd == "store"
            if words[0] == "kvcentric-router":
                assert {w.split("=")[0] for w in words if w.startswith("--")} <= router_flags
            elif "vllm.entrypoints.openai.api_server" in words:
                vllm_lines.append(words[3:])
            elif "sglang.launch_server" in words:
                sglang_lines.append(words[3:])
    assert vllm_lines and sglang_lines
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        pytest.skip("vLLM (with its launchers.cli_args) is not installed")
    parser = make_arg_parser(FlexibleArgumentParser())
    for words in vllm_lines:
        assert parser.parse_args(words).kv_transfer_config is not None
    # SGLang's imports change process-wide state (see tests/helpers/sglang_harness.py):
    # parse in a child process
    code = ("import argparse, json, sys\n"
            "try:\n    from sglang.srt.server_args import ServerArgs\n"
            "except ImportError:\n    print('skip'); sys.exit(0)\n"
            "sp = argparse.ArgumentParser(); ServerArgs.add_cli_args(sp)\n"
            "print(json.dumps([sp.parse_args(w).hicache_storage_backend "
            "for w in json.loads(sys.argv[1])]))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(sglang_lines)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]  # 2: SystemExit on a bad flag
    if run.stdout.strip() == "skip":
        pytest.skip("SGLang is not installed")
    assert json.loads(run.stdout.strip().splitlines()[-1]) == ["dynamic"] * len(sglang_lines)


def _strip_labels(template: Any) -> Any:
    t = copy.deepcopy(dict(template))
    meta = t.pop("metadata", None) or {}
    meta.pop("labels", None)
    return {**t, "metadata": meta} if meta else t


@pytest.mark.parametrize("variant", VARIANTS)
def test_plain_mirrors_rbg(variant: str) -> None:
    """plain.yaml runs the same pods as rbg.yaml, under the same DNS names."""
    rbg, plain = load(DEPLOY / variant / "rbg.yaml"), load(DEPLOY / variant / "plain.yaml")
    a = {wl.name: wl for wl in workloads(rbg)}
    b = {wl.name: wl for wl in workloads(plain)}
    assert a.keys() == b.keys()
    for name, wl in a.items():
        assert _strip_labels(wl.template) == _strip_labels(b[name].template), name
        assert wl.replicas == b[name].replicas
        if b[name].kind == "StatefulSet":
            assert b[name].hosts() == wl.hosts(), name
    for kind in ("Secret", "ConfigMap"):
        assert by_kind(rbg, kind) == by_kind(plain, kind)
    ports_of = {n: s["spec"]["ports"] for n, s in by_kind(rbg, "Service").items()}
    assert ports_of == {n: s["spec"]["ports"] for n, s in by_kind(plain, "Service").items()
                        if n in ports_of}


def _selects(selector: dict[str, Any], labels: Any) -> bool:
    """A label selector (matchLabels, matchExpressions In/NotIn/Exists) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if op in ("In", "NotIn") and (labels.get(key) in values) != (op == "In"):
            return False
        if op in ("Exists", "DoesNotExist") and (key in labels) != (op == "Exists"):
            return False
    return True


def _ingress(docs: list[dict[str, Any]]) -> dict[str, list[tuple[set[str] | None, set[Any]]]]:
    """Per workload role: its ingress rules as (roles of this group allowed, or None for
    any source outside a pod selector of the group; the ports, empty for all)."""
    wls = list(workloads(docs))
    out: dict[str, list[tuple[set[str] | None, set[Any]]]] = {}
    for pol in by_kind(docs, "NetworkPolicy").values():
        spec = pol["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        chosen = [wl for wl in wls if _selects(spec["podSelector"], wl.labels)]
        assert chosen, f"NetworkPolicy {pol['metadata']['name']} selects no pod"
        for rule in spec["ingress"]:
            rule_ports = {p["port"] for p in rule.get("ports", [])}
            for wl in chosen:  # named ports are ports the selected pods declare
                declared = {k for c in pod_containers(wl.template) for k in ports(c)}
                assert {p for p in rule_ports if isinstance(p, str)} <= declared, pol
            sources: set[str] | None = set()
            for peer in rule.get("from", [None]):
                if peer is None or set(peer) != {"podSelector"}:
                    sources = None  # anywhere, another namespace or an ipBlock
                    break
                assert sources is not None
                sources |= {wl.role for wl in wls if _selects(peer["podSelector"], wl.labels)}
            for wl in chosen:
                out.setdefault(wl.role, []).append((sources, rule_ports))
    return out


MOONCAKE_MANIFESTS = [p for p in MANIFESTS if "mooncake-master" in p.read_text()]


@pytest.mark.parametrize("path", MOONCAKE_MANIFESTS,
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_mooncake_is_reachable_only_from_its_group(path: Path) -> None:
    """Mooncake has no authentication: the master's rpc and metadata ports and every port of
    a storage node are open only to the group's own Mooncake pods (engines, router, storage
    nodes); outside sources reach only the master's metrics port. Every Mooncake client
    (each listens with its transfer engine) is covered by a policy too, its Mooncake
    traffic limited to the group and anything else to its declared HTTP port."""
    docs = load(path)
    rules = _ingress(docs)
    clients = {wl.role for wl, c in containers(docs) if "MOONCAKE_MASTER" in env(c)}
    members = clients | {"mooncake-master"}
    assert {"mooncake-master", "mooncake-store"} <= clients | {"mooncake-master"}
    assert members <= rules.keys(), f"no NetworkPolicy for {members - rules.keys()}"
    master = rules["mooncake-master"]
    for sources, open_ports in master:
        if sources is None:
            assert open_ports == {"metrics"}, "only metrics is open outside the group"
        else:
            assert sources <= members and open_ports, sources
    assert any(s is not None and clients - {"mooncake-master"} <= s and {"rpc", "metadata"}
               <= p for s, p in master), "every Mooncake client reaches the master"
    for sources, _ in rules["mooncake-store"]:
        assert sources is not None and clients <= sources <= members
    for role in clients - {"mooncake-store"}:
        for sources, open_ports in rules[role]:
            assert (sources is not None and sources <= members) or open_ports == {"http"}, \
                (role, sources, open_ports)
    text = (DEPLOY / "README.md").read_text()
    for needed in ("NetworkPolicy", "no authentication", "verify_checksums"):
        assert needed in text, f"deploy/kubernetes/README.md lacks {needed!r}"


@pytest.mark.parametrize("variant", [p.parent.name for p in MOONCAKE_MANIFESTS
                                     if p.name == "rbg.yaml"])
def test_plain_policies_mirror_rbg(variant: str) -> None:
    rbg, plain = load(DEPLOY / variant / "rbg.yaml"), load(DEPLOY / variant / "plain.yaml")
    assert by_kind(rbg, "NetworkPolicy").keys() == by_kind(plain, "NetworkPolicy").keys()

    def canon(docs: list[dict[str, Any]]) -> Any:
        return {role: sorted((sorted(s) if s is not None else ["*"], sorted(p))
                             for s, p in rules) for role, rules in _ingress(docs).items()}

    assert canon(rbg) == canon(plain)


def test_dockerfile_and_images() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert f"ARG ENGINE_IMAGE=vllm/vllm-openai:v{TESTED_VLLM[0]}" in text
    assert f"ENGINE_IMAGE=lmsysorg/sglang:v{TESTED_SGLANG[0]}" in text
    for src in re.findall(r"^COPY (.+) /opt/kvcentric/?\S*$", text, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part
    extras = re.search(r'\[(router,mooncake)\]', text)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert extras and all(f"\n{e} = [" in pyproject for e in extras.group(1).split(","))
    built = set(re.findall(r"-t (ghcr.io/\S+)", text))
    for path in MANIFESTS:
        images = {c["image"] for _, c in containers(load(path))}
        assert images <= built, f"{path}: {images - built} is not the image the Dockerfile builds"


@pytest.mark.parametrize("variant", VARIANTS)
def test_readmes(variant: str) -> None:
    text = (DEPLOY / variant / "README.md").read_text()
    for needed in ("kubectl apply -f rbg.yaml", "kubectl apply -f plain.yaml", "Dockerfile",
                   "kvcentric doctor", "Values to change"):
        assert needed in text, f"{variant}/README.md lacks {needed!r}"
    top = (DEPLOY / "README.md").read_text()
    assert f"{variant}/" in top
