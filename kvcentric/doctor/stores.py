"""Diagnoses of the store: the local coordinator and its tmpfs, or the Mooncake master
and transport. Read-only: never start a coordinator, never map the arena in."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcentric.config import StoreConfig
from kvcentric.doctor.findings import FAIL, OK, WARN, Finding, gib
from kvcentric.store.local.ownership import generation_files


def diagnosis_config(cfg: StoreConfig) -> StoreConfig:
    """``cfg`` as the doctor opens it: never start a coordinator, never map the arena's
    pages in, fail fast."""
    from kvcentric.store.backends import passive_config

    return passive_config(cfg, 3.0)


def check_local_store(cfg: StoreConfig) -> tuple[Finding, dict[str, Any] | None]:
    """The local store's coordinator answers; returns its stats too."""
    from kvcentric.store import StoreUnavailable, open_store

    try:
        with open_store(diagnosis_config(cfg)) as store:
            stats = store.stats()
    except (StoreUnavailable, OSError, ValueError) as exc:
        return Finding("store-reachable", FAIL, f"local store {cfg.name!r} in "
                       f"{cfg.local.runtime_dir} is not reachable: {exc}",
                       f"start it (kvcentric store serve --name {cfg.name} --capacity ...) "
                       "or let the engine start it (autostart), and give engines, router "
                       "and doctor the same name and runtime_dir"), None
    return Finding("store-reachable", OK, f"local store {cfg.name!r}: "
                   f"{gib(stats['used_bytes'])} of {gib(stats['capacity_bytes'])} used, "
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
    capacity = int(stats["capacity_bytes"]) if stats else cfg.local.capacity_bytes
    runtime_dir = cfg.local.runtime_dir
    where = runtime_dir if runtime_dir.is_dir() else runtime_dir.parent
    try:
        st = os.statvfs(where)
    except OSError as exc:
        return Finding("store-shm", FAIL, f"runtime_dir {cfg.local.runtime_dir}: {exc}",
                       "create the directory on a memory-backed file system (/dev/shm)")
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    arena_resident = 0  # the live arena (reserved whole) and dead ones still mapped
    for path in generation_files(cfg, "arena"):
        with contextlib.suppress(OSError):
            arena_resident += path.stat().st_blocks * 512
    details = {"capacity_bytes": capacity, "fs_bytes": size, "fs_free_bytes": free,
               "arena_resident_bytes": arena_resident, "fs_type": _fs_type(where)}
    fix = (f"lower the store capacity below {gib(size)}, or give {where} more room (on "
           "Kubernetes: an emptyDir with medium: Memory and sizeLimit >= capacity, mounted "
           "at /dev/shm)")
    if capacity > size:
        return Finding("store-shm", FAIL, f"store capacity {gib(capacity)} exceeds the "
                       f"{gib(size)} file system at {where}: the store cannot reserve its "
                       "arena and refuses to start", fix, details)
    if capacity - arena_resident > free:
        return Finding("store-shm", WARN, f"store capacity {gib(capacity)} needs "
                       f"{gib(capacity - arena_resident)} more, but only {gib(free)} of "
                       f"{where} is free (other files share it)", fix, details)
    if details["fs_type"] not in ("tmpfs", "hugetlbfs", "ramfs", ""):
        return Finding("store-shm", WARN, f"runtime_dir {where} is on "
                       f"{details['fs_type']}, not tmpfs: the arena pages go to disk",
                       "put runtime_dir on /dev/shm (KVCENTRIC_RUNTIME_DIR)", details)
    return Finding("store-shm", OK, f"store capacity {gib(capacity)} fits {where} "
                   f"({gib(size)}, {gib(free)} free)", details=details)


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
    return Finding("mooncake-master", OK, f"master {host}:{port}: pool {gib(used)} of "
                   f"{gib(cap)} used", details=details)


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


def store_findings(cfg: StoreConfig) -> list[Finding]:
    """The store's findings: its backend's ``doctor_checks`` (``kvcentric.store.backends``)."""
    from kvcentric.store.backends import BACKENDS

    return BACKENDS[cfg.backend].doctor_checks(cfg)
