"""Start, find and stop local store coordinators.

The first client that finds no coordinator starts one as a detached process (its own
session, so it outlives the client); a file lock makes concurrent first clients start
exactly one, and the coordinator's own lifetime lock (:mod:`~kvcentric.store.local.ownership`)
makes sure no client starts one while another lives, even a stopped one. ``kvcentric
store serve`` runs one in the foreground instead.
"""

from __future__ import annotations

import fcntl
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvcentric.config import StoreConfig
from kvcentric.store.base import StoreUnavailable
from kvcentric.store.local import ownership


def config_json(cfg: StoreConfig) -> str:
    """Serialise what the coordinator needs of ``cfg``."""
    raw: dict[str, object] = {
        "name": cfg.name, "capacity_bytes": cfg.capacity_bytes,
        "runtime_dir": str(cfg.runtime_dir), "idle_timeout_s": cfg.idle_timeout_s,
        "lease_ttl_s": cfg.lease_ttl_s}
    if cfg.disk is not None:
        d = cfg.disk
        raw["disk"] = {"path": str(d.path), "capacity_bytes": d.capacity_bytes,
                       "writers": d.writers, "high_watermark": d.high_watermark,
                       "dirty_limit": d.dirty_limit, "put_wait_s": d.put_wait_s}
    return json.dumps(raw)


def is_running(cfg: StoreConfig) -> bool:
    """True when a coordinator accepts connections on ``cfg.socket_path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(cfg.socket_path))
        return True
    except OSError:
        return False
    finally:
        s.close()


@contextmanager
def start_lock(cfg: StoreConfig) -> Iterator[None]:
    """Exclusive lock held while checking for and starting a coordinator."""
    cfg.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(cfg.lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_running(cfg: StoreConfig) -> None:
    """Make sure a coordinator serves ``cfg``; start a detached one if none lives.

    Never starts a second coordinator: one that holds the store's lock but does not answer
    (stopped, swamped) is reported, not replaced (:mod:`kvcentric.store.local.ownership`).
    Raises ``StoreUnavailable`` (the store error contract, docs/architecture.md §4) when
    none answers and none can be started: the runtime dir cannot be created or locked, a
    silent coordinator holds the store, the process cannot be spawned, it refuses to start
    (the message says why, e.g. the arena does not fit its tmpfs), or it does not answer
    within ``cfg.start_timeout_s``.
    """
    if is_running(cfg):
        return
    log_path = cfg.runtime_dir / f"{cfg.name}.log"
    try:
        with start_lock(cfg):
            if is_running(cfg):
                return
            pid = ownership.holder(cfg)
            if pid is not None:
                raise StoreUnavailable(
                    f"the coordinator of store {cfg.name!r} (pid {pid or 'unknown'}) holds "
                    f"{cfg.owner_path} but does not answer at {cfg.socket_path}; not "
                    "starting a second one")
            with open(log_path, "ab") as logf:
                start = logf.tell()
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvcentric.store.local.server",
                     "--config-json", config_json(cfg), "--detach"],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                )
            if proc.wait(timeout=cfg.start_timeout_s) != 0:
                raise StoreUnavailable(f"store coordinator failed to start: "
                                       f"{_last_line(log_path, start)} (see {log_path})")
            _wait_up(cfg, log_path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise StoreUnavailable(f"cannot start the store coordinator in {cfg.runtime_dir}: "
                               f"{exc}") from exc


def _last_line(path: Path, start: int) -> str:
    """The last non-empty line written to ``path`` after byte ``start`` (the refusing
    coordinator's message) or a placeholder."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            lines = [ln.strip() for ln in f.read(1 << 16).decode(errors="replace").splitlines()]
    except OSError:
        return "no message"
    return next((ln for ln in reversed(lines) if ln), "no message")


def _wait_up(cfg: StoreConfig, log_path: Path) -> None:
    deadline = time.monotonic() + cfg.start_timeout_s
    while time.monotonic() < deadline:
        if is_running(cfg):
            return
        time.sleep(0.02)
    raise StoreUnavailable(f"store coordinator did not start in {cfg.start_timeout_s} s; "
                           f"see {log_path}")


def stop(cfg: StoreConfig, timeout_s: float = 10.0) -> bool:
    """Ask the coordinator of ``cfg`` to shut down; True if one was running."""
    from kvcentric.store.local.rpc import RpcClient

    if not is_running(cfg):
        return False
    with RpcClient(cfg.socket_path, timeout_s) as rpc:
        rpc.connect()
        rpc.call("shutdown")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and is_running(cfg):
        time.sleep(0.02)
    return True


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
