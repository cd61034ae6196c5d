"""RDMA NIC discovery for the Mooncake backend: which devices to hand the transfer engine.

With ``protocol: rdma`` and an empty ``device_name``, the backend lists the RDMA devices
(``pyverbs`` when importable, else the same facts from ``/sys/class/infiniband``), keeps
those with an ACTIVE port, and prefers the ones on the NUMA node of the memory they will
move (the GPU's node when one is given, else the node of the CPUs this process runs on).
On a machine without usable RDMA it says so; tcp is used only if the config allows it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvcentric.store")

SYS_IB = Path("/sys/class/infiniband")
SYS_CPU = Path("/sys/devices/system/cpu")
PORT_ACTIVE = 4  # ibv_port_state.IBV_PORT_ACTIVE


class RdmaUnavailable(RuntimeError):
    """No usable RDMA device; the message says what was found."""


@dataclass(frozen=True)
class RdmaDevice:
    """One RDMA device: its name, ACTIVE port numbers and NUMA node (-1: unknown)."""

    name: str
    active_ports: tuple[int, ...]
    numa_node: int


def _numa_of(name: str, sys_ib: Path = SYS_IB) -> int:
    try:
        return int((sys_ib / name / "device" / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1


def _from_pyverbs() -> list[RdmaDevice] | None:
    try:
        from pyverbs.device import Context, get_device_list  # type: ignore[import-not-found]
    except ImportError:
        return None
    out = []
    for dev in get_device_list():
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        with Context(name=name) as ctx:
            ports = int(ctx.query_device().phys_port_cnt)
            active = tuple(p for p in range(1, ports + 1)
                           if int(ctx.query_port(p).state) == PORT_ACTIVE)
        out.append(RdmaDevice(name, active, _numa_of(name)))
    return out


def _from_sysfs(sys_ib: Path = SYS_IB) -> list[RdmaDevice]:
    if not sys_ib.is_dir():
        return []
    out = []
    for dev in sorted(sys_ib.iterdir()):
        active = []
        for port in sorted((dev / "ports").glob("*"), key=lambda p: int(p.name)):
            try:  # e.g. "4: ACTIVE"
                state = int((port / "state").read_text().split(":", 1)[0])
            except (OSError, ValueError):
                continue
            if state == PORT_ACTIVE:
                active.append(int(port.name))
        out.append(RdmaDevice(dev.name, tuple(active), _numa_of(dev.name, sys_ib)))
    return out


def list_devices() -> tuple[list[RdmaDevice], str]:
    """All RDMA devices and where the list came from (``"pyverbs"`` or ``"sysfs"``)."""
    found = _from_pyverbs()
    if found is not None:
        return found, "pyverbs"
    return _from_sysfs(), "sysfs"


def cpu_numa_node(cpus: set[int] | None = None, sys_cpu: Path = SYS_CPU) -> int:
    """The NUMA node of most of ``cpus`` (default: this process's affinity); -1 unknown."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    counts: dict[int, int] = {}
    for cpu in cpus:
        for node in (sys_cpu / f"cpu{cpu}").glob("node[0-9]*"):
            n = int(node.name[4:])
            counts[n] = counts.get(n, 0) + 1
    return max(counts, key=lambda n: counts[n]) if counts else -1


def gpu_numa_node(pci_bus_id: str) -> int:
    """NUMA node of the PCI device ``pci_bus_id`` (e.g. ``0000:3b:00.0``); -1 unknown."""
    try:
        return int(Path(f"/sys/bus/pci/devices/{pci_bus_id.lower()}/numa_node").read_text())
    except (OSError, ValueError):
        return -1


def choose(devices: list[RdmaDevice], numa_node: int) -> list[str]:
    """Devices with an ACTIVE port, those on ``numa_node`` first-and-only when any are.

    Devices of unknown node count as local (single-socket machines report -1)."""
    active = [d for d in devices if d.active_ports]
    local = [d for d in active if numa_node < 0 or d.numa_node in (numa_node, -1)]
    return [d.name for d in (local or active)]


def discover(numa_node: int | None = None) -> list[str]:
    """Names of the RDMA devices to use; raises :class:`RdmaUnavailable` when none is."""
    devices, source = list_devices()
    node = cpu_numa_node() if numa_node is None else numa_node
    names = choose(devices, node)
    if not names:
        if not devices:
            raise RdmaUnavailable(f"no RDMA devices on this machine (looked via {source})")
        raise RdmaUnavailable(f"no RDMA device has an ACTIVE port (via {source}): "
                              + ", ".join(d.name for d in devices))
    log.info("RDMA devices for mooncake (via %s, NUMA node %d): %s", source, node, names)
    return names


def resolve_transport(protocol: str, device_name: str, fallback_to_tcp: bool,
                      numa_node: int | None = None) -> tuple[str, str]:
    """The (protocol, device list) to pass Mooncake's ``setup``.

    tcp passes through; rdma with devices named passes through; rdma with none named
    discovers them, and without usable RDMA either falls back to tcp (if allowed, with a
    warning) or raises :class:`RdmaUnavailable`."""
    if protocol != "rdma" or device_name:
        return protocol, device_name
    try:
        return "rdma", ",".join(discover(numa_node))
    except RdmaUnavailable as exc:
        if not fallback_to_tcp:
            raise RdmaUnavailable(f"{exc}; set protocol 'tcp' or fallback_to_tcp: true") from exc
        log.warning("%s: falling back to tcp as configured", exc)
        return "tcp", ""
