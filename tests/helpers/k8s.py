"""Read the Kubernetes manifests of deploy/kubernetes as the cluster would see them.

A :class:`Workload` is one set of identical pods: an RBG role (the controller names them
``<group>-<role>-<i>`` behind the headless Service ``s-<group>-<role>`` and labels them
``rolebasedgroup.workloads.x-k8s.io/{name,role}``), a StatefulSet or a Deployment. The
helpers resolve what a container would run: its environment (``$(VAR)`` expanded in
order, the pod IP as :data:`POD_IP`), its command line, its listening flags.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
RBG_API = "workloads.x-k8s.io/v1alpha1"
RBG_NAME = "rolebasedgroup.workloads.x-k8s.io/name"
RBG_ROLE = "rolebasedgroup.workloads.x-k8s.io/role"
POD_IP = "10.1.2.3"
SECRET = "<from-secret>"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class Workload:
    kind: str  # RoleBasedGroup, StatefulSet, Deployment
    name: str  # pods are <name>-<i>
    role: str
    replicas: int
    template: Mapping[str, Any]
    labels: Mapping[str, str]
    service: str | None  # the headless Service giving pods DNS names

    def hosts(self) -> list[str]:
        if self.service is None:
            return []
        return [self.service] + [f"{self.name}-{i}.{self.service}" for i in range(self.replicas)]


def workloads(docs: list[dict[str, Any]]) -> Iterator[Workload]:
    for d in docs:
        if d["kind"] == "RoleBasedGroup":
            group = d["metadata"]["name"]
            for r in d["spec"]["roles"]:
                tpl = r["template"]
                labels = {**(tpl.get("metadata") or {}).get("labels", {}),
                          RBG_NAME: group, RBG_ROLE: r["name"]}
                yield Workload(d["kind"], f"{group}-{r['name']}", r["name"], r["replicas"], tpl,
                               labels, f"s-{group}-{r['name']}")
        elif d["kind"] in ("StatefulSet", "Deployment"):
            tpl = d["spec"]["template"]
            labels = tpl["metadata"]["labels"]
            yield Workload(d["kind"], d["metadata"]["name"],
                           labels.get("app.kubernetes.io/component", d["metadata"]["name"]),
                           d["spec"].get("replicas", 1), tpl, labels,
                           d["spec"].get("serviceName"))


def pod_containers(template: Mapping[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def ports(container: Mapping[str, Any]) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"]
            for p in container.get("ports", [])}


def env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``$(VAR)`` expands only to
    variables defined earlier in the list (later or unknown ones stay literal)."""
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = _VAR.sub(lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            out[e["name"]] = POD_IP
        else:
            out[e["name"]] = SECRET
    return out


def unresolved(container: Mapping[str, Any]) -> list[str]:
    """``$(VAR)`` references in env values, command and args that would stay literal."""
    seen: set[str] = set()
    bad = []
    for e in container.get("env", []):
        bad += [f"env {e['name']}: $({v})" for v in _VAR.findall(e.get("value", ""))
                if v not in seen]
        seen.add(e["name"])
    for word in list(container.get("command", [])) + list(container.get("args", [])):
        bad += [f"arg {word!r}: $({v})" for v in _VAR.findall(word) if v not in seen]
    return bad


def argv(container: Mapping[str, Any]) -> list[str]:
    """The command line the container runs (``sh -c`` scripts: the ``exec``'d command)."""
    e = env(container)
    words = [_VAR.sub(lambda m: e.get(m.group(1), m.group(0)), w)
             for w in list(container.get("command", [])) + list(container.get("args", []))]
    if words[:2] != ["sh", "-c"]:
        return words
    script = re.sub(r'"?\$([A-Z_]+)"?', lambda m: e.get(m.group(1), m.group(0)), words[2])
    for part in script.split("&&"):
        toks = shlex.split(part)
        if toks and toks[0] == "exec":
            return toks[1:]
    raise AssertionError(f"no exec in the script of {container['name']}: {script}")


def flag(words: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``words`` (None when absent)."""
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def _relabel(rule: Mapping[str, Any], labels: dict[str, str]) -> bool:
    """Apply one Prometheus relabel rule (keep or replace); False when it drops."""
    value = rule.get("separator", ";").join(labels.get(s, "") for s in
                                            rule.get("source_labels", []))
    m = re.fullmatch(rule.get("regex", "(.*)"), value)
    if rule.get("action", "replace") == "keep":
        return m is not None
    if m is not None:
        labels[rule["target_label"]] = m.expand(
            re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1")))
    return True


def relabel_jobs(relabel: list[Mapping[str, Any]], annotations: Mapping[str, str],
                 container: Mapping[str, Any], job: str = "kvcentric") -> list[str]:
    """Jobs Prometheus's pod discovery + ``relabel`` (of the scrape job ``job``) gives
    ``container``'s ports."""
    jobs = []
    for port_name in ports(container):
        labels = {"job": job,
                  "__meta_kubernetes_pod_annotation_kvcentric_io_scrape":
                      annotations.get("kvcentric.io/scrape", ""),
                  "__meta_kubernetes_pod_container_port_name": port_name,
                  "__meta_kubernetes_pod_container_name": container["name"]}
        if all(_relabel(r, labels) for r in relabel):
            jobs.append(labels["job"])
    return jobs
