"""The local store's coordinator: owns the arena file and all metadata; moves no data.

One coordinator per (runtime_dir, name). Clients map the arena themselves and copy bytes
directly; the coordinator only hands out offsets, leases and commits over a Unix socket.
It reclaims a client's leases and pending writes when that client's connection closes,
which is how a crashed (SIGKILLed) engine's state is cleaned up.

Run: ``python -m kvcentric.store.local.server --config-json '{...}'`` (normally started by
:func:`kvcentric.store.local.launcher.ensure_running` or ``kvcentric store serve``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import secrets
import selectors
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

from kvcentric.config import StoreConfig
from kvcentric.store.local.index import ObjectIndex
from kvcentric.store.metrics import log_line

log = logging.getLogger("kvcentric.store")
STATS_LOG_INTERVAL_S = 30.0
ONE_WAY = frozenset({"release"})  # requests that get no reply


class Coordinator:
    """Serves the index over a Unix socket until ``shutdown`` or the idle timeout."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.index = ObjectIndex(cfg.capacity_bytes)
        self.arena_id = secrets.token_hex(8)
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, Connection] = {}
        self._running = True
        self._idle_since = time.monotonic()

    def _create_arena(self) -> None:
        self.cfg.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.cfg.arena_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.cfg.capacity_bytes)
        finally:
            os.close(fd)

    def _listen(self) -> socket.socket:
        path = str(self.cfg.socket_path)
        if os.path.exists(path):
            os.unlink(path)  # stale: the launcher holds the lock and found nobody answering
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    def serve(self) -> None:
        """Create the arena, accept clients and answer them until stopped."""
        self._create_arena()
        lsock = self._listen()
        self._sel.register(lsock, selectors.EVENT_READ, None)
        log.info("kvcentric local store %r up: %s, capacity %d B, pid %d", self.cfg.name,
                 self.cfg.arena_path, self.cfg.capacity_bytes, os.getpid())
        last_log = time.monotonic()
        try:
            while self._running:
                for skey, _ in self._sel.select(timeout=1.0):
                    if skey.data is None:
                        self._accept(lsock)
                    else:
                        self._handle(skey.data)
                now = time.monotonic()
                if now - last_log >= STATS_LOG_INTERVAL_S:
                    log.info("%s", log_line(self.index.stats()))
                    last_log = now
                if self._idle_expired(now):
                    log.info("idle for %.0f s with no clients; exiting", self.cfg.idle_timeout_s)
                    break
        finally:
            self._cleanup(lsock)

    def _idle_expired(self, now: float) -> bool:
        if self._conns:
            self._idle_since = now
            return False
        return self.cfg.idle_timeout_s > 0 and now - self._idle_since >= self.cfg.idle_timeout_s

    def _accept(self, lsock: socket.socket) -> None:
        try:
            sock, _ = lsock.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        conn = Connection(sock.detach())
        self._conns[conn.fileno()] = conn
        self._sel.register(conn.fileno(), selectors.EVENT_READ, conn)

    def _handle(self, conn: Connection) -> None:
        owner = conn.fileno()
        try:
            request = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._drop(owner)
            return
        try:
            reply: Any = self._dispatch(owner, request)
        except Exception as exc:  # a bad request must not kill the coordinator
            log.exception("bad request %r", request[:1])
            reply = ("error", f"{type(exc).__name__}: {exc}")
        if request[0] in ONE_WAY:
            return
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._drop(owner)

    def _drop(self, owner: int) -> None:
        conn = self._conns.pop(owner, None)
        if conn is None:
            return
        self._sel.unregister(owner)
        conn.close()
        leases, pending = self.index.drop_owner(owner)
        if leases or pending:
            log.info("client gone: reclaimed %d leases, %d pending writes", leases, pending)

    def _dispatch(self, owner: int, req: tuple[Any, ...]) -> Any:
        op, args = req[0], req[1:]
        idx = self.index
        if op == "exists":
            return idx.leading_run(args[0])
        if op == "reserve":
            keys, sizes, parents = args
            return [idx.reserve(k, s, p, owner) for k, s, p in zip(keys, sizes, parents)]
        if op == "commit":
            return [idx.commit(k, owner, c) for k, c in zip(*args)]
        if op == "abort":
            for k in args[0]:
                idx.abort(k, owner)
            return None
        if op == "acquire":
            lease_id, entries = idx.acquire(args[0], owner)
            return lease_id, [(e.offset, e.size, e.checksum) for e in entries]
        if op == "release":
            idx.release(args[0], owner)
            return None
        if op == "remove":
            return idx.remove(args[0], args[1])
        if op == "keys":
            return idx.list_keys(args[0], args[1])
        if op == "clear":
            return idx.clear()
        if op == "stats":
            return {**idx.stats(), "pid": os.getpid(), "clients": len(self._conns)}
        if op == "hello":
            return {"arena": str(self.cfg.arena_path), "capacity": idx.alloc.capacity,
                    "arena_id": self.arena_id, "pid": os.getpid()}
        if op == "shutdown":
            self._running = False
            return None
        raise ValueError(f"unknown op {op!r}")

    def _cleanup(self, lsock: socket.socket) -> None:
        for owner in list(self._conns):
            self._drop(owner)
        self._sel.close()
        lsock.close()
        for path in (self.cfg.socket_path, self.cfg.arena_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        log.info("kvcentric local store %r stopped", self.cfg.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvcentric local store coordinator")
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--detach", action="store_true",
                    help="fork into the background (the launcher's parent exits at once)")
    args = ap.parse_args(argv)
    if args.detach and os.fork() > 0:
        os._exit(0)  # the daemon is re-parented to init: no zombie in the starting engine
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Coordinator(StoreConfig.from_dict(json.loads(args.config_json))).serve()


if __name__ == "__main__":
    main()
