"""``kvcentric doctor``: the misconfigurations users hit, each found and explained.

    kvcentric doctor [--store JSON] [--router-config FILE] [--url ENGINE_URL] [--json]

One function per diagnosis, each returning :class:`Finding` s (``ok``, ``warn``, ``fail``
or ``skip``, a message and how to fix it); :func:`run` picks the ones the inputs allow and
the CLI exits 1 when any failed. Checks only read: the store is opened without starting a
coordinator or prefaulting its arena, and Mooncake is asked over its master's HTTP
endpoints (no client joins the pool). The one exception is the layout probe
(:mod:`kvcentric.doctor_probe`), which sends the engine at ``--url`` one completion.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvcentric.compat import TESTED_SGLANG, TESTED_VLLM
from kvcentric.config import EngineEnv, StoreConfig
from kvcentric.store.local.ownership import generation_files

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_TARGET = "kvcentric.connector.vllm.plugin:register"


@dataclass(frozen=True)
class Finding:
    """One diagnosis: ``check`` names it, ``status`` is ok/warn/fail/skip."""

    check: str
    status: str
    message: str
    fix: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["details"] = dict(self.details)
        return out


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


# ---- engines installed here ----
_PROBE = """
import importlib, json, sys
from pathlib import Path
module, probe = sys.argv[1], sys.argv[2]
try:
    mod = importlib.import_module(module)
except ImportError:
    print(json.dumps({"installed": False})); sys.exit(0)
out = {"installed": True, "version": str(getattr(mod, "__version__", "unknown")),
       "path": str(Path(getattr(mod, "__file__", "") or "?").parent), "error": None}
try:
    pmod, func = probe.split(":")
    getattr(importlib.import_module(pmod), func)()
except RuntimeError as exc:
    out["error"], out["missing_hook"] = str(exc), True
except Exception as exc:
    out["error"], out["missing_hook"] = f"{type(exc).__name__}: {exc}", False
print(json.dumps(out))
"""


def _engine_version(check: str, name: str, module: str, tested: tuple[str, ...],
                    probe: str) -> Finding:
    """Import engine ``module`` and run kvcentric's start-up API check ``probe``
    (``module:function``) in a child process (importing an engine changes process-wide
    state: SGLang's imports do), then compare the version with ``tested``."""
    import json
    import subprocess
    import sys

    try:
        run = subprocess.run([sys.executable, "-c", _PROBE, module, probe],
                             capture_output=True, text=True, timeout=300)
        got = json.loads(run.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return Finding(check, FAIL, f"could not inspect {name}: {exc}",
                       f"run python -c 'import {module}' to see why")
    if not got["installed"]:
        return Finding(check, SKIP, f"{name} is not installed here")
    version, where = got["version"], got["path"]
    details = {"version": version, "path": where, "tested": list(tested)}
    fix = f"install {name} {' or '.join(tested)} (the versions kvcentric is tested with)"
    if got["error"] and got["missing_hook"]:  # a hook kvcentric needs is missing
        return Finding(check, FAIL, got["error"], fix, details)
    if got["error"]:  # an engine too old or broken to import at all
        return Finding(check, FAIL, f"{name} {version} at {where} lacks the API kvcentric "
                       f"plugs into ({got['error']})", fix, details)
    if version.split("+", 1)[0] not in tested:
        return Finding(check, WARN, f"{name} {version} has every hook kvcentric needs but "
                       f"is untested (tested: {', '.join(tested)})", fix, details)
    return Finding(check, OK, f"{name} {version} (tested)", details=details)


def check_vllm_version() -> Finding:
    return _engine_version("vllm-version", "vLLM", "vllm", TESTED_VLLM,
                           "kvcentric.connector.vllm.connector:check_vllm")


def check_sglang_version() -> Finding:
    return _engine_version("sglang-version", "SGLang", "sglang", TESTED_SGLANG,
                           "kvcentric.connector.sglang.storage:check_sglang")


def check_engine_url_version(url: str) -> Finding:
    """The vLLM version the engine at ``url`` reports (``GET /version``)."""
    try:
        r = httpx.get(url.rstrip("/") + "/version", timeout=5)
        r.raise_for_status()
        version = str(r.json()["version"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Finding("engine-url-version", FAIL, f"engine at {url} does not answer "
                       f"/version: {exc}", "check --url (the engine's http://host:port)")
    details = {"url": url, "version": version}
    if version.split("+", 1)[0] not in TESTED_VLLM:
        return Finding("engine-url-version", WARN, f"engine at {url} runs vLLM {version}, "
                       f"untested (tested: {', '.join(TESTED_VLLM)})",
                       f"run vLLM {' or '.join(TESTED_VLLM)}", details)
    return Finding("engine-url-version", OK, f"engine at {url} runs vLLM {version}",
                   details=details)


def check_plugin() -> Finding:
    """The ``vllm.general_plugins`` entry point that registers ``KVCentricConnector``."""
    from importlib.metadata import entry_points

    import kvcentric

    fix = ("pip install kvcentric into the engine's environment (or give vLLM "
           "\"kv_connector_module_path\": \"kvcentric.connector.vllm\")")
    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == "kvcentric"]
    if not eps:
        return Finding("connector-plugin", FAIL, f"no '{PLUGIN_GROUP}' entry point named "
                       f"kvcentric: kvcentric imports from {Path(kvcentric.__file__).parent} "
                       "but is not installed there, so vLLM never registers "
                       "KVCentricConnector", fix)
    allowed = EngineEnv.from_environ().vllm_plugins
    if allowed is not None and "kvcentric" not in allowed.split(","):
        return Finding("connector-plugin", FAIL, f"VLLM_PLUGINS={allowed!r} leaves the "
                       "kvcentric plugin out", "add kvcentric to VLLM_PLUGINS or unset it")
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return Finding("connector-plugin", SKIP, "vLLM is not installed here")
    if eps[0].value != PLUGIN_TARGET:
        return Finding("connector-plugin", FAIL, f"the kvcentric entry point names "
                       f"{eps[0].value}, not {PLUGIN_TARGET} (a stale install)", fix)
    eps[0].load()()
    if "KVCentricConnector" not in KVConnectorFactory._registry:
        return Finding("connector-plugin", FAIL, "the plugin ran but vLLM's connector "
                       "factory does not know KVCentricConnector", fix)
    return Finding("connector-plugin", OK, "vLLM plugin registers KVCentricConnector",
                   details={"entry_point": eps[0].value})


# ---- the store ----
def diagnosis_config(cfg: StoreConfig) -> StoreConfig:
    """``cfg`` as the doctor opens it: never start a coordinator, never map the arena's
    pages in, fail fast."""
    return cfg.with_(autostart=False, prefault=False, op_timeout_s=min(cfg.op_timeout_s, 3.0),
                     reconnect_interval_s=0.0)


def check_local_store(cfg: StoreConfig) -> tuple[Finding, dict[str, Any] | None]:
    """The local store's coordinator answers; returns its stats too."""
    from kvcentric.store import StoreUnavailable, open_store

    try:
        with open_store(diagnosis_config(cfg)) as store:
            stats = store.stats()
    except (StoreUnavailable, OSError, ValueError) as exc:
        return Finding("store-reachable", FAIL, f"local store {cfg.name!r} in "
                       f"{cfg.runtime_dir} is not reachable: {exc}",
                       f"start it (kvcentric store serve --name {cfg.name} --capacity ...) "
                       "or let the engine start it (autostart), and give engines, router "
                       "and doctor the same name and runtime_dir"), None
    return Finding("store-reachable", OK, f"local store {cfg.name!r}: "
                   f"{_gib(stats['used_bytes'])} of {_gib(stats['capacity_bytes'])} used, "
                   f"{stats['keys']} keys", details={"stats": stats}), stats


def _fs_type(path: Path) -> str:
    """File system type of the mount holding ``path`` (``/proc/mounts``; "" unknown)."""
    best, fstype = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) > 2 and (target == parts[1] or target.startswith(
                parts[1].rstrip("/") + "/")) and len(parts[1]) >= len(best):
            best, fstype = parts[1], parts[2]
    return fstype


def check_shm(cfg: StoreConfig, stats: Mapping[str, Any] | None) -> Finding:
    """The arena's capacity against the tmpfs it lives on: a coordinator reserves its whole
    arena at start and refuses to start when it does not fit (engines then recompute)."""
    capacity = int(stats["capacity_bytes"]) if stats else cfg.capacity_bytes
    where = cfg.runtime_dir if cfg.runtime_dir.is_dir() else cfg.runtime_dir.parent
    try:
        st = os.statvfs(where)
    except OSError as exc:
        return Finding("store-shm", FAIL, f"runtime_dir {cfg.runtime_dir}: {exc}",
                       "create the directory on a memory-backed file system (/dev/shm)")
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    arena_resident = 0  # the live arena (reserved whole) and dead ones still mapped
    for path in generation_files(cfg, "arena"):
        with contextlib.suppress(OSError):
            arena_resident += path.stat().st_blocks * 512
    details = {"capacity_bytes": capacity, "fs_bytes": size, "fs_free_bytes": free,
               "arena_resident_bytes": arena_resident, "fs_type": _fs_type(where)}
    fix = (f"lower the store capacity below {_gib(size)}, or give {where} more room (on "
           "Kubernetes: an emptyDir with medium: Memory and sizeLimit >= capacity, mounted "
           "at /dev/shm)")
    if capacity > size:
        return Finding("store-shm", FAIL, f"store capacity {_gib(capacity)} exceeds the "
                       f"{_gib(size)} file system at {where}: the store cannot reserve its "
                       "arena and refuses to start", fix, details)
    if capacity - arena_resident > free:
        return Finding("store-shm", WARN, f"store capacity {_gib(capacity)} needs "
                       f"{_gib(capacity - arena_resident)} more, but only {_gib(free)} of "
                       f"{where} is free (other files share it)", fix, details)
    if details["fs_type"] not in ("tmpfs", "hugetlbfs", "ramfs", ""):
        return Finding("store-shm", WARN, f"runtime_dir {where} is on "
                       f"{details['fs_type']}, not tmpfs: the arena pages go to disk",
                       "put runtime_dir on /dev/shm (KVCENTRIC_RUNTIME_DIR)", details)
    return Finding("store-shm", OK, f"store capacity {_gib(capacity)} fits {where} "
                   f"({_gib(size)}, {_gib(free)} free)", details=details)


def check_mooncake_master(settings: Any) -> Finding:
    """The master's RPC port accepts and its metrics answer; the pool has capacity."""
    from kvcentric.store import StoreUnavailable
    from kvcentric.store.mooncake.health import tcp_accepts
    from kvcentric.store.mooncake.http import fetch_metrics

    host, port = settings.master_host_port
    fix = ("start it (kvcentric store mooncake-master --host ADDR) and point "
           "master_server_address / MOONCAKE_MASTER at it")
    if not tcp_accepts(host, port, 2.0):
        return Finding("mooncake-master", FAIL, f"Mooncake master {host}:{port} does not "
                       "accept connections", fix)
    try:
        m = fetch_metrics(settings.metrics_url, 3.0)
    except StoreUnavailable as exc:
        return Finding("mooncake-master", FAIL, f"master {host}:{port} accepts, but its "
                       f"metrics do not answer: {exc}", "set metrics_url (default: master "
                       "host, port 9003) to the master's --metrics_port")
    cap = m.get("master_total_capacity_bytes", 0.0)
    used = m.get("master_allocated_bytes", 0.0)
    details = {"master": f"{host}:{port}", "capacity_bytes": cap, "used_bytes": used}
    if cap <= 0:
        return Finding("mooncake-master", WARN, f"master {host}:{port} is up but the pool "
                       "has no memory: no storage node (or engine with a segment) joined",
                       "start kvcentric store mooncake-node --segment 16gb ... (or give "
                       "engines global_segment_size)", details)
    return Finding("mooncake-master", OK, f"master {host}:{port}: pool {_gib(used)} of "
                   f"{_gib(cap)} used", details=details)


def check_transport(settings: Any) -> Finding:
    """tcp, or rdma with usable NICs (discovered as the backend would)."""
    from kvcentric.store.mooncake.rdma import RdmaUnavailable, list_devices, resolve_transport

    devices, source = list_devices()
    names = [d.name for d in devices if d.active_ports]
    details = {"protocol": settings.protocol, "active_rdma_devices": names, "source": source}
    if settings.protocol == "tcp":
        if names:
            return Finding("transport", WARN, f"tcp while RDMA NICs are up ({', '.join(names)})"
                           ": transfers run at TCP speed", "set protocol rdma "
                           "(MOONCAKE_PROTOCOL=rdma)", details)
        return Finding("transport", OK, "tcp (no RDMA NIC here)", details=details)
    try:
        proto, devs = resolve_transport(settings.protocol, settings.device_name,
                                        settings.fallback_to_tcp)
    except RdmaUnavailable as exc:
        return Finding("transport", FAIL, str(exc), "use protocol tcp, set fallback_to_tcp, "
                       "or give the pod its RDMA device (e.g. rdma/hca resource)", details)
    if proto == "tcp":
        return Finding("transport", WARN, "rdma requested, no usable NIC: falling back to "
                       "tcp", "give the pod its RDMA device", details)
    return Finding("transport", OK, f"rdma on {devs}", details={**details, "devices": devs})


# ---- the whole run ----
@dataclass(frozen=True)
class DoctorInputs:
    store: StoreConfig | None = None
    router_config: str | None = None
    url: str | None = None


def store_findings(cfg: StoreConfig) -> list[Finding]:
    if cfg.backend == "local":
        reach, stats = check_local_store(cfg)
        return [reach, check_shm(cfg, stats)]
    from kvcentric.store.mooncake.config import MooncakeSettings

    try:
        settings = MooncakeSettings.load(cfg.mooncake)
    except ValueError as exc:
        return [Finding("mooncake-config", FAIL, f"Mooncake settings: {exc}",
                        "fix the store's mooncake mapping or the MOONCAKE_* variables")]
    return [check_mooncake_master(settings), check_transport(settings)]


def run(inputs: DoctorInputs) -> list[Finding]:
    """Every check the inputs allow, in a fixed order."""
    from kvcentric import doctor_probe

    out = [check_vllm_version(), check_sglang_version()]
    if all(f.status == SKIP for f in out):
        out.append(Finding("engines", WARN, "neither vLLM nor SGLang is installed here",
                           "run the doctor where the engine runs"))
    out.append(check_plugin())
    router = None
    if inputs.router_config:
        router, finding = doctor_probe.load_router(inputs.router_config)
        out.append(finding)
    store = inputs.store or (router.store if router is not None else None)
    if store is not None:
        out += store_findings(store)
    probe = None
    if inputs.url:
        out.append(check_engine_url_version(inputs.url))
        roles = {i.url: i.role for i in router.instances} if router is not None else {}
        if roles.get(inputs.url.rstrip("/")) == "decode":
            out.append(Finding("layout-signature", SKIP, f"{inputs.url} is a decode instance "
                               "(kv_consumer: it never saves); probe a prefill one"))
        elif store is not None:
            finding, probe = doctor_probe.check_layout(store, inputs.url)
            out.append(finding)
    if router is not None:
        out += doctor_probe.check_router(router, probe)
    return out


def render(findings: list[Finding]) -> str:
    marks = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL", SKIP: "skip"}
    lines = []
    for f in findings:
        lines.append(f"[{marks[f.status]}] {f.check}: {f.message}")
        if f.fix and f.status in (WARN, FAIL):
            lines.append(f"       fix: {f.fix}")
    bad = sum(f.status == FAIL for f in findings)
    lines.append(f"{bad} problem(s), {sum(f.status == WARN for f in findings)} warning(s)")
    return "\n".join(lines)
