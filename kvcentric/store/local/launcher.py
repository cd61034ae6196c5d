"""Start, find and stop local store coordinators.

The first client that finds no coordinator starts one as a detached process (its own
session, so it outlives the client); a file lock makes concurrent first clients start
exactly one, and the coordinator's own lifetime lock (:mod:`~kvcentric.store.local.ownership`)
makes sure no client starts one while another lives, even a stopped one. ``kvcentric
store serve`` runs one in the foreground instead.

Nothing here touches a runtime dir before it passed its checks
(:func:`kvcentric.store.local.trust.check_dir`): an untrusted one is ``Untrusted`` (a
``StoreUnavailable`` naming its path, owner and mode). The coordinator's config, which may
hold the disk tier's seal key, reaches it on a pipe, not its command line.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from kvcentric.config import StoreConfig
from kvcentric.store.base import StoreUnavailable
from kvcentric.store.local import gate, ownership, trust
from kvcentric.store.local.config import lock_path, owner_path, socket_path, token_path


def config_json(cfg: StoreConfig) -> str:
    """Serialise ``cfg`` for the coordinator (:meth:`StoreConfig.to_mapping`; it parses the
    JSON back with :meth:`StoreConfig.from_dict`). Holds the seal key: a pipe's payload."""
    return json.dumps(replace(cfg, sections={"local": cfg.local}).to_mapping())  # its own only


def is_running(cfg: StoreConfig) -> bool:
    """True when a coordinator accepts connections on its :func:`socket_path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(socket_path(cfg)))
        return True
    except OSError:
        return False
    finally:
        s.close()


@contextmanager
def start_lock(cfg: StoreConfig) -> Iterator[None]:
    """Exclusive lock held while checking for and starting a coordinator; creates the
    runtime dir (``0700``) and refuses one that is not ours to trust (``Untrusted``)."""
    trust.check_dir(cfg.local.runtime_dir, "store runtime directory", create=True)
    fd = trust.open_or_create(lock_path(cfg), os.O_RDWR, "store start lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _check_dir(cfg: StoreConfig) -> bool:
    """True when the runtime dir exists and may be trusted by a client, False when it
    does not exist; ``Untrusted`` otherwise."""
    try:
        trust.check_dir(cfg.local.runtime_dir, "store runtime directory", gid=cfg.local.peer_gid,
                        mine=False)
    except FileNotFoundError:
        return False
    return True


def ensure_running(cfg: StoreConfig) -> None:
    """Make sure a coordinator serves ``cfg``; start a detached one if none lives.

    Never starts a second coordinator: one that holds the store's lock but does not answer
    (stopped, swamped) is reported, not replaced (:mod:`kvcentric.store.local.ownership`).
    Raises ``StoreUnavailable`` (the store error contract, docs/store.md §Contract) when
    none answers and none can be started: the runtime dir cannot be created or locked, a
    silent coordinator holds the store, the process cannot be spawned, it refuses to start
    (the message says why, e.g. the arena does not fit its tmpfs), or it does not answer
    within ``cfg.local.start_timeout_s``; ``Untrusted`` for a runtime dir not to be trusted.
    """
    if _check_dir(cfg) and is_running(cfg):
        return
    log_path = cfg.local.runtime_dir / f"{cfg.name}.log"
    try:
        with start_lock(cfg):
            if is_running(cfg):
                return
            pid = ownership.holder(cfg)
            if pid is not None:
                raise StoreUnavailable(
                    f"the coordinator of store {cfg.name!r} (pid {pid or 'unknown'}) holds "
                    f"{owner_path(cfg)} but does not answer at {socket_path(cfg)}; not "
                    "starting a second one")
            logfd = trust.open_or_create(log_path, os.O_WRONLY | os.O_APPEND, "store log")
            try:
                start = os.lseek(logfd, 0, os.SEEK_END)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvcentric.store.local.server",
                     "--config-json", "-", "--name", cfg.name, "--detach"],
                    stdin=subprocess.PIPE, stdout=logfd, stderr=logfd, start_new_session=True,
                )
            finally:
                os.close(logfd)
            assert proc.stdin is not None
            with proc.stdin:  # a pipe, not argv: other users can read a command line
                proc.stdin.write(config_json(cfg).encode())
            if proc.wait(timeout=cfg.local.start_timeout_s) != 0:
                raise StoreUnavailable(f"store coordinator failed to start: "
                                       f"{_last_line(log_path, start)} (see {log_path})")
            _wait_up(cfg, log_path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise StoreUnavailable(f"cannot start the store coordinator in {cfg.local.runtime_dir}: "
                               f"{exc}") from exc


def _last_line(path: Path, start: int) -> str:
    """The last non-empty line written to ``path`` after byte ``start`` (the refusing
    coordinator's message) or a placeholder."""
    try:
        fd = trust.open_file(path, os.O_RDONLY, "store log")
        try:
            raw = os.pread(fd, 1 << 16, start)
        finally:
            os.close(fd)
    except (OSError, trust.Untrusted):
        return "no message"
    lines = [ln.strip() for ln in raw.decode(errors="replace").splitlines()]
    return next((ln for ln in reversed(lines) if ln), "no message")


def _wait_up(cfg: StoreConfig, log_path: Path) -> None:
    deadline = time.monotonic() + cfg.local.start_timeout_s
    while time.monotonic() < deadline:
        if is_running(cfg):
            return
        time.sleep(0.02)
    raise StoreUnavailable(f"store coordinator did not start in {cfg.local.start_timeout_s} s; "
                           f"see {log_path}")


def stop(cfg: StoreConfig, timeout_s: float = 10.0) -> bool:
    """Ask the coordinator of ``cfg`` to shut down, with its admin token, and wait (up to
    ``timeout_s``) until it let go of the store; True if one was running. ``Untrusted``
    for a runtime dir, token or coordinator not to be trusted, ``StoreUnavailable`` when
    the token cannot be read or is refused."""
    from kvcentric.store.local.rpc import RpcClient

    if not _check_dir(cfg) or not is_running(cfg):
        return False
    try:
        token = gate.read_token(cfg)
    except OSError as exc:
        raise StoreUnavailable(f"cannot stop store {cfg.name!r}: its admin token "
                               f"{token_path(cfg)} cannot be read: {exc}") from exc
    with RpcClient(socket_path(cfg), timeout_s) as rpc:
        rpc.connect(lambda sock: trust.check_peer(sock, os.geteuid(), socket_path(cfg)))
        try:
            rpc.call("auth", token)
            rpc.call("shutdown")
        except ValueError as exc:
            raise StoreUnavailable(f"cannot stop store {cfg.name!r}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    # gone once it let go of the store's lock (after finishing its disk writes), not
    # when its socket goes silent: a start right after stop() must not find it holding on
    while time.monotonic() < deadline and (is_running(cfg)
                                           or ownership.holder(cfg) is not None):
        time.sleep(0.02)
    return True


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
