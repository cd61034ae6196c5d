"""The local store's coordinator: owns the arena file and all metadata; moves no data.

One coordinator per (runtime_dir, name), each a new generation with fresh files
(:mod:`kvcentric.store.local.ownership`). Clients map the arena themselves and copy bytes
directly; the coordinator only hands out offsets, leases and commits over a Unix socket
(msgpack frames, :mod:`kvcentric.store.local.wire`) and publishes the committed set in a
shared-memory lookup index (:mod:`kvcentric.store.local.shared_index`).
It reclaims a client's leases and pending writes when that client's connection closes,
which is how a crashed (SIGKILLed) engine's state is cleaned up, and leases older than
``lease_ttl_s``, so a hung client cannot pin objects forever. A client that sends bytes
that are not a valid frame is disconnected (and so reclaimed): any exception while a frame
is read, decoded or checked closes that connection only, never the coordinator; the loop
never blocks on one client's socket. Who may connect and who may run admin operations
(clear, shutdown, long pins) is :mod:`kvcentric.store.local.gate`'s.

Run: ``python -m kvcentric.store.local.server --config-json '{...}'`` (``-``: read it from
stdin, as the launcher does; normally started by
:func:`kvcentric.store.local.launcher.ensure_running` or ``kvcentric store serve``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import selectors
import socket
import sys
import time
from collections import deque
from typing import Any

from kvcentric.config import StoreConfig
from kvcentric.store.local import gate, trust, wire
from kvcentric.store.local.config import disk_dir, socket_path, token_path
from kvcentric.store.local.demoter import DiskWorker
from kvcentric.store.local.events import StoreEvents
from kvcentric.store.local.gate import Forbidden, Gate
from kvcentric.store.local.holdback import Holdback
from kvcentric.store.local.index import ObjectIndex
from kvcentric.store.local.ownership import Generation, StartRefused
from kvcentric.store.local.shared_index import SharedIndexWriter, slots_for
from kvcentric.store.local.tiered import TieredIndex
from kvcentric.store.metrics import log_line

log = logging.getLogger("kvcentric.store")
STATS_LOG_INTERVAL_S = 30.0
LEASE_SWEEP_INTERVAL_S = 1.0
MAX_UNSENT = 64 << 20  # a client that stops reading its replies is dropped beyond this
ONE_WAY = frozenset({"release", "settle"})  # requests that get no reply
# requests that never write the shared index
READ_ONLY = frozenset({"exists", "residency", "hello", "stats", "keys", "release"})
DISK_EVENT = "disk"  # selector data of the disk worker's wake-up pipe
REPLAY_EVENT = "replay"  # selector data of the KV event replay socket


class _Client:
    """One connected client: its socket and the bytes of its unfinished frame."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = wire.FrameBuffer()
        self.unsent = bytearray()  # replies the socket did not take yet
        self.queued: deque[tuple[str, list[Any]]] = deque()  # behind a held-back reserve
        self.admin = False  # presented the admin token


class Coordinator:
    """Serves the index over a Unix socket until ``shutdown`` or the idle timeout."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.local = local = cfg.local
        self._disk: DiskWorker | None = None
        self.index: ObjectIndex
        self._holdback: Holdback | None = None  # reserves waiting for the disk tier
        tier_dir = disk_dir(cfg)
        if local.disk is not None and tier_dir is not None:
            self.index = TieredIndex(local.capacity_bytes, local.disk.capacity_bytes,
                                     tier_dir.absolute(), local.disk.high_watermark,
                                     self._submit, dirty_limit=local.disk.dirty_fraction,
                                     pin_cap=local.pinned_bytes_cap)
            self._holdback = Holdback(self.index, local.disk.put_wait_s)
        else:
            self.index = ObjectIndex(local.capacity_bytes, pin_cap=local.pinned_bytes_cap)
        self.gen: Generation | None = None
        self._gate: Gate | None = None
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Client] = {}
        self._shared: SharedIndexWriter | None = None
        self._running = True
        self._idle_since = time.monotonic()
        self._sock_ino = -1  # the inode of the socket we listen on (see _reachable)
        self._events: StoreEvents | None = None

    def prepare(self) -> None:
        """Claim the store and reserve its memory (the lifetime lock, a fresh arena and
        lookup index, the admin token, the disk tier's directory); ``StartRefused`` says
        why it cannot. Runs before a detaching fork, so a refusal reaches the launcher as
        this process's exit status and message."""
        gen = Generation.claim(self.cfg)
        what = f"reserve the store's lookup index at {gen.index_path}"
        try:
            self._shared = SharedIndexWriter(gen.index_path, slots_for(self.local.capacity_bytes),
                                             gen.gid)
            what = f"write the store's admin token at {token_path(self.cfg)}"
            self._gate = Gate(self.cfg, gate.write_token(self.cfg))
            if isinstance(self.index, TieredIndex):
                what = f"create the disk tier's directory {self.index.root}"
                trust.check_dir(self.index.root, "disk tier directory", gid=gen.gid,
                                create=True)
        except (OSError, trust.Untrusted) as exc:
            if self._gate is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(token_path(self.cfg))
            gen.release()
            raise StartRefused(str(exc) if isinstance(exc, trust.Untrusted) else
                               f"cannot {what}: {exc}") from exc
        self.gen = gen

    def _submit(self, job: object) -> None:
        assert self._disk is not None
        self._disk.submit(job)

    def _start_disk(self) -> None:
        """Start the disk tier's I/O threads and the rebuild of its index from its files."""
        if not isinstance(self.index, TieredIndex):
            return
        assert self.local.disk is not None and self.gen is not None  # prepare() checked root
        key = self.local.disk.seal_key
        self._disk = DiskWorker(self.gen.arena_path, self.local.capacity_bytes, self.index.root,
                                self.local.disk.writers, key.encode() if key else None,
                                self.gen.gid)
        self._sel.register(self._disk.wake_fd, selectors.EVENT_READ, DISK_EVENT)
        self.index.recovering = True
        self._disk.submit("recover")

    def _start_events(self) -> None:
        """Bind the KV event publisher (after any detaching fork: ZMQ's threads do not
        survive one). An address that cannot be bound is logged and the store serves
        without events: they are opt-in metadata, and a store that refused KV over its
        event port would turn a monitoring problem into recomputes everywhere."""
        if self.local.events is None:
            return
        try:
            self._events = StoreEvents(self.local.events, self.cfg.name)
        except Exception as exc:  # noqa: BLE001 -- zmq.ZMQError, without importing zmq here
            log.error("store %r: KV events off: cannot bind %s / %s: %s", self.cfg.name,
                      self.local.events.endpoint, self.local.events.replay_endpoint, exc)
            return
        self.index.events = self._events
        fd = self._events.replay_fd
        if fd is not None:
            self._sel.register(fd, selectors.EVENT_READ, REPLAY_EVENT)

    def _disk_turn(self, now: float, woken: bool) -> None:
        """Apply finished disk I/O and queue more demotions (never waits for the disk)."""
        idx = self.index
        if self._disk is None or not isinstance(idx, TieredIndex):
            return
        results = self._disk.results() if woken else []
        if results or idx.needs_pump(now):
            with self._write_section("disk"):
                for r in results:
                    idx.apply(r, now)
                idx.pump(now)

    def _listen(self) -> socket.socket:
        path = str(socket_path(self.cfg))
        if os.path.exists(path):
            os.unlink(path)  # stale: the launcher holds the lock and found nobody answering
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)  # in the runtime dir only we can write: nobody swaps it meanwhile
        self._sock_ino = os.stat(path).st_ino
        if self.gen is not None and self.gen.gid is not None:
            os.chown(path, -1, self.gen.gid)
        os.chmod(path, 0o600 if self.gen is None or self.gen.gid is None else 0o660)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    def serve(self) -> None:
        """Claim the store (unless :meth:`prepare` did), accept clients and answer them
        until stopped."""
        if self.gen is None:
            self.prepare()
        assert self.gen is not None and self._shared is not None
        self.gen.record_pid()  # after a detaching fork, the pid is the child's
        self.index.shared = self._shared
        self._start_events()  # before the disk tier: its recovered files are events too
        self._start_disk()
        lsock = self._listen()
        self._sel.register(lsock, selectors.EVENT_READ, None)
        log.info("kvcentric local store %r up: %s, capacity %d B, pid %d", self.cfg.name,
                 self.gen.arena_path, self.local.capacity_bytes, os.getpid())
        last_log = last_sweep = time.monotonic()
        try:
            while self._running:
                woken = False
                for skey, events in self._sel.select(timeout=self._select_timeout()):
                    if skey.data is None:
                        self._accept(lsock)
                        continue
                    if skey.data == DISK_EVENT:
                        woken = True
                        continue
                    if skey.data == REPLAY_EVENT:
                        continue  # answered below, after this turn's events are out
                    try:
                        if events & selectors.EVENT_WRITE and not self._flush(skey.data):
                            continue
                        if events & selectors.EVENT_READ:
                            self._handle(skey.data)
                    except Exception:  # one client's trouble is never the coordinator's
                        log.exception("dropping client %d", skey.fd)
                        self._drop(skey.fd)
                now = time.monotonic()
                self._disk_turn(now, woken)
                self._holdback_turn(now)
                if self._events is not None:
                    self._events.flush()
                    self._events.serve_replays()
                self._shared.beat()
                if self.local.lease_ttl_s > 0 and now - last_sweep >= LEASE_SWEEP_INTERVAL_S:
                    self._expire_leases(now)
                    last_sweep = now
                if now - last_log >= STATS_LOG_INTERVAL_S:
                    log.info("%s", log_line(self.index.stats()))
                    last_log = now
                if self._idle_expired(now):
                    break
        finally:
            self._cleanup(lsock)

    def _select_timeout(self) -> float:
        held = self._holdback.timeout(time.monotonic()) if self._holdback else None
        return LEASE_SWEEP_INTERVAL_S if held is None else min(held, LEASE_SWEEP_INTERVAL_S)

    def _holdback_turn(self, now: float) -> None:
        """Answer the held-back reserves that now have room or reached their deadline,
        then the requests each client sent behind its own."""
        if self._holdback is None or self._holdback.timeout(now) is None:
            return
        with self._write_section("reserve"):
            done = self._holdback.due(now)
        for owner, codes in done:
            client = self._conns.get(owner)
            if client is not None and self._reply(client, codes):
                self._answer(client)

    def _idle_expired(self, now: float) -> bool:
        """No clients, and idle for ``idle_timeout_s`` or unreachable for good: our socket
        path no longer names our socket (its runtime dir was removed), so no new client
        can connect (a test session's store, an operator's rm -rf: never an orphan)."""
        if self._conns:
            self._idle_since = now
            return False
        if not self._reachable():
            log.info("%s no longer names this coordinator's socket; exiting",
                     socket_path(self.cfg))
            return True
        if self.local.idle_timeout_s > 0 and now - self._idle_since >= self.local.idle_timeout_s:
            log.info("idle for %.0f s with no clients; exiting", self.local.idle_timeout_s)
            return True
        return False

    def _reachable(self) -> bool:
        try:
            return os.stat(socket_path(self.cfg)).st_ino == self._sock_ino
        except OSError:
            return False

    def _accept(self, lsock: socket.socket) -> None:
        try:
            sock, _ = lsock.accept()
        except BlockingIOError:
            return
        assert self._gate is not None
        why = self._gate.admit(sock)
        if why is not None:  # before a byte of it is read
            log.warning("refusing a connection: %s", why)
            sock.close()
            return
        sock.setblocking(False)
        client = _Client(sock)
        self._conns[sock.fileno()] = client
        self._sel.register(sock.fileno(), selectors.EVENT_READ, client)

    def _handle(self, client: _Client) -> None:
        """Read what ``client`` sent and answer every complete request in it."""
        owner = client.sock.fileno()
        try:
            data = client.sock.recv(1 << 20)
            if not data:
                raise EOFError
            requests = [wire.request_of(wire.decode_request(p))
                        for p in client.frames.feed(data)]
        except BlockingIOError:
            return
        except Exception as exc:  # EOF, I/O, a frame too big, too deep, not a request...
            if not isinstance(exc, EOFError):
                log.warning("dropping client %d: %s: %s", owner, type(exc).__name__,
                            str(exc)[:200])
            self._drop(owner)
            return
        client.queued.extend(requests)
        self._answer(client)

    def _answer(self, client: _Client) -> None:
        """Answer ``client``'s queued requests in order, up to a held-back reserve (its
        reply, and so the requests behind it, come from :meth:`_holdback_turn`)."""
        owner = client.sock.fileno()
        assert self._gate is not None
        while client.queued and not (self._holdback and self._holdback.holds(owner)):
            op, raw = client.queued.popleft()
            try:
                args = wire.checked_args(op, raw)
                if op == "auth":
                    self._gate.auth(args[0])
                    client.admin = True
                    reply: Any = True
                else:
                    self._gate.check(client.admin, op, args)
                    with self._write_section(op):
                        reply = self._dispatch(owner, op, args)
            except Forbidden as exc:  # answered, then the connection is closed
                log.warning("refusing %r from client %d: %s", op[:32], owner, exc)
                if self._reply(client, ["error", f"Forbidden: {exc}"]):  # sent if it fits
                    self._drop(owner)
                return
            except Exception as exc:  # a bad request must not kill the coordinator
                log.warning("bad request %r: %s: %s", op[:32], type(exc).__name__, exc)
                reply = ["error", f"{type(exc).__name__}: {exc}"]
            if op in ONE_WAY or reply is None and op == "reserve":
                continue  # one-way, or held back: answered later
            if not self._reply(client, reply):
                return

    def _write_section(self, op: str) -> Any:
        if self._shared is None or op in READ_ONLY:
            return contextlib.nullcontext()
        return self._shared.write()

    def _reply(self, client: _Client, reply: Any) -> bool:
        """Queue ``reply`` and send what the socket takes now; never blocks the loop."""
        try:
            client.unsent += wire.encode(reply)
        except ValueError as exc:
            client.unsent += wire.encode(["error", str(exc)])
        return self._flush(client)

    def _flush(self, client: _Client) -> bool:
        """Send queued bytes; False if the client was dropped."""
        owner = client.sock.fileno()
        try:
            while client.unsent:
                sent = client.sock.send(client.unsent)
                del client.unsent[:sent]
        except BlockingIOError:
            pass
        except OSError as exc:
            log.warning("dropping client %d: cannot send reply: %s", owner, exc)
            self._drop(owner)
            return False
        if len(client.unsent) > MAX_UNSENT:
            log.warning("dropping client %d: %d B of replies unread", owner, len(client.unsent))
            self._drop(owner)
            return False
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.unsent else 0)
        if self._sel.get_key(owner).events != want:
            self._sel.modify(owner, want, client)
        return True

    def _drop(self, owner: int) -> None:
        client = self._conns.pop(owner, None)
        if client is None:
            return
        if self._holdback is not None:
            self._holdback.forget(owner)
        self._sel.unregister(owner)
        client.sock.close()
        with self._write_section("drop"):
            leases, pending = self.index.drop_owner(owner)
        if leases or pending:
            log.info("client gone: reclaimed %d leases, %d pending writes", leases, pending)

    def _expire_leases(self, now: float) -> None:
        with self._write_section("expire"):
            expired = self.index.expire_leases(now - self.local.lease_ttl_s)
        if expired:
            log.warning("reclaimed %d read leases older than %.0f s", expired,
                        self.local.lease_ttl_s)

    def _dispatch(self, owner: int, op: str, args: tuple[Any, ...]) -> Any:
        """Run one checked request (:func:`wire.checked_args`, :meth:`Gate.check`)."""
        idx = self.index
        if op == "exists":
            return idx.leading_run(args[0])
        if op == "residency":
            return list(idx.residency(args[0]))
        if op == "reserve":
            keys, sizes, parents = args
            if not len(keys) == len(sizes) == len(parents):
                raise ValueError("reserve: keys, sizes and parents differ in length")
            if self._holdback is not None:  # None: held back, answered later
                return self._holdback.reserve(owner, keys, sizes, parents, time.monotonic())
            return [idx.reserve(k, s, p, owner) for k, s, p in zip(keys, sizes, parents)]
        if op == "commit":
            keys, sums, pin_s = args  # pin_s: bounded by the gate
            if len(keys) != len(sums):
                raise ValueError("commit: keys and checksums differ in length")
            return [idx.commit(k, owner, c, pin_s) for k, c in zip(keys, sums)]
        if op == "abort":
            for k in args[0]:
                idx.abort(k, owner)
            return None
        if op == "acquire":
            lease_id, entries = idx.acquire(args[0], owner)
            return [lease_id, idx.lease_reply(lease_id, entries)]
        if op == "release":
            idx.release(args[0], owner)
            return None
        if op == "settle":
            if isinstance(idx, TieredIndex):
                idx.settle(args[0], owner, args[1])
            else:
                idx.release(args[0], owner)
            return None
        if op == "remove":
            return idx.remove(args[0], args[1])
        if op == "keys":
            return idx.list_keys(args[0], args[1])
        if op == "clear":
            return idx.clear()
        if op == "stats":
            shared = self._shared
            return {**idx.stats(), "pid": os.getpid(), "clients": len(self._conns),
                    "shared_index": int(bool(shared and shared.enabled)),
                    "refused_peers": self._gate.refused_peers if self._gate else 0}
        if op == "hello":
            shared = self._shared
            assert self.gen is not None
            return {"arena": str(self.gen.arena_path), "capacity": idx.alloc.capacity,
                    "generation": self.gen.id, "pid": os.getpid(),
                    "index": str(self.gen.index_path) if shared and shared.enabled else None,
                    "lease_ttl_s": self.local.lease_ttl_s,
                    "disk_tier": isinstance(idx, TieredIndex),
                    "disk_dir": str(idx.root) if isinstance(idx, TieredIndex) else None,
                    "max_pin_s": self.local.max_pin_s,
                    # clients' hot-path bound covers a reserve held back this long
                    "reserve_wait_s": (self.local.disk.put_wait_s if self.local.disk is not None
                                       and self._holdback is not None else 0.0)}
        if op == "shutdown":
            self._running = False
            return None
        raise AssertionError(f"op {op!r} has a signature but no handler")

    def _cleanup(self, lsock: socket.socket) -> None:
        for owner in list(self._conns):
            self._drop(owner)
        self._sel.close()
        lsock.close()
        if self._disk is not None:
            self._disk.close()  # finishes queued writes; the tier's files stay for a restart
        if self._events is not None:
            self._events.flush()
            self._events.close()
        if self._shared is not None:
            self._shared.disable("coordinator stopped")
            self._shared.close()
        if self._reachable():  # else the path is gone or another store's now: leave it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path(self.cfg))
        if self.gen is not None:
            if self._gate is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(token_path(self.cfg))
            self.gen.release()  # last: the lock keeps a second coordinator out until here
        log.info("kvcentric local store %r stopped", self.cfg.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvcentric local store coordinator")
    ap.add_argument("--config-json", required=True, help="the store's config; - reads it "
                    "from stdin (the launcher's way: a seal key must not be on a command line)")
    ap.add_argument("--name", default=None, help="the store's name, checked against the "
                    "config's (so that ps tells coordinators apart)")
    ap.add_argument("--detach", action="store_true",
                    help="fork into the background (the launcher's parent exits at once)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    raw = sys.stdin.read() if args.config_json == "-" else args.config_json
    cfg = StoreConfig.from_dict(json.loads(raw))
    if args.name is not None and args.name != cfg.name:
        ap.error(f"--name {args.name!r} is not the config's store {cfg.name!r}")
    coordinator = Coordinator(cfg)
    try:
        coordinator.prepare()
    except StartRefused as exc:
        print(f"kvcentric local store refused to start: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.detach and os.fork() > 0:
        os._exit(0)  # the daemon is re-parented to init: no zombie in the starting engine
    coordinator.serve()


if __name__ == "__main__":
    main()
