"""A fake local-store coordinator: speaks the protocol, and lies as it is told to.

    python -m tests.helpers.fake_coordinator --runtime-dir D --name N --lie LIE
        [--socket PATH] [--tier DIR] [--outside FILE] [--capacity BYTES] [--log FILE]

It creates a real arena file of its generation in ``D`` (``--socket`` may put its socket
elsewhere, e.g. in a directory of another user), prints ``ready`` once it listens, then
answers every connection on a thread of its own until killed. ``--log`` gets one line per
connection, per request op and per connection closed, so a test can tell whether a client
ever reached it and, once it hung up, all it sent.

Lies (``truthful`` tells none): ``arena-outside`` (the hello's arena is ``--outside``),
``arena-symlink`` (the arena's name is a symlink to ``--outside``), ``arena-small`` (a
capacity larger than the file), ``index-outside``, ``generation-traversal``,
``reserve-offset`` (slots past the arena's end), ``acquire-offset`` (a lease past the
arena's end), ``promo-offset``, ``disk-outside`` (an object file outside the tier),
``disk-traversal`` (``tier/ab/../../..``), ``disk-wrong-key`` (a tier file named for
another key), ``disk-symlink`` (a tier path of the right name that is a symlink to
``--outside``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import xxhash

from kvcentric.store.local import wire
from kvcentric.store.local.disk import DATA_OFFSET, SUFFIX

GEN = secrets.token_hex(16)


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lie: str = args.lie
        self.dir = Path(args.runtime_dir)
        self.capacity = args.capacity
        self.arena = self.dir / f"{args.name}.arena.{GEN}"
        self.objects: dict[str, tuple[int, int]] = {}
        self.next_off = 0
        self.lock = threading.Lock()
        if self.lie == "arena-symlink":
            self.arena.symlink_to(args.outside)
        else:
            with open(self.arena, "wb") as f:
                f.truncate(self.capacity if self.lie != "arena-small" else 4096)

    def log(self, line: str) -> None:
        if self.args.log:
            with open(self.args.log, "a") as f:
                f.write(line + "\n")

    def hello(self) -> dict[str, Any]:
        h: dict[str, Any] = {"arena": str(self.arena), "capacity": self.capacity,
                             "generation": GEN, "pid": os.getpid(), "index": None,
                             "lease_ttl_s": 300.0, "disk_tier": self.args.tier is not None,
                             "disk_dir": self.args.tier, "max_pin_s": 60.0,
                             "reserve_wait_s": 0.0}
        if self.lie == "arena-outside":
            h["arena"] = self.args.outside
        elif self.lie == "arena-small":
            h["capacity"] = self.capacity * 4
        elif self.lie == "index-outside":
            h["index"] = self.args.outside
        elif self.lie == "generation-traversal":
            h["generation"] = "../../" + GEN[6:]
        return h

    def reserve(self, keys: list[str], sizes: list[int]) -> list[int]:
        out = []
        for k, n in zip(keys, sizes):
            off = self.capacity - 64 if self.lie == "reserve-offset" else self.next_off
            self.next_off += (n + 63) // 64 * 64
            self.objects[k] = (off, n)
            out.append(off)
        return out

    def _tier_file(self, key: str, other: str | None = None) -> str:
        h = xxhash.xxh3_128_hexdigest((other or key).encode())
        return f"{self.args.tier}/{h[:2]}/{h}-fake{SUFFIX}"

    def _outside_sum(self, n: int) -> int:
        """The checksum of ``--outside``'s payload: a client that read it would accept
        its bytes as the object's (only the path checks stand in the way)."""
        with open(self.args.outside, "rb") as f:
            f.seek(DATA_OFFSET)
            return xxhash.xxh3_64_intdigest(f.read(n))

    def acquire(self, keys: list[str]) -> list[Any]:
        entries: list[Any] = []
        for k in keys:
            if k not in self.objects:
                break
            off, n = self.objects[k]
            lie, fsum = self.lie, self._outside_sum(n) if self.lie.startswith("disk") else 0
            if lie == "acquire-offset":
                entries.append([self.capacity - 8, n, None])
            elif lie == "promo-offset":
                entries.append([self.capacity, n, None, self._tier_file(k), 0])
            elif lie == "disk-outside":
                entries.append([-1, n, None, self.args.outside, fsum])
            elif lie == "disk-traversal":
                h = xxhash.xxh3_128_hexdigest(k.encode())
                sub = f"{self.args.tier}/{h[:2]}"
                os.makedirs(sub, exist_ok=True)  # so that the kernel would resolve the ..
                entries.append([-1, n, None, f"{sub}/{os.path.relpath(self.args.outside, sub)}",
                                fsum])
            elif lie == "disk-wrong-key":
                path = Path(self._tier_file(k, other=k + "x"))  # another key's object
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(Path(self.args.outside).read_bytes()[:DATA_OFFSET + n])
                entries.append([-1, n, None, str(path), fsum])
            elif lie == "disk-symlink":
                path = Path(self._tier_file(k))
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.is_symlink():
                    path.symlink_to(self.args.outside)
                entries.append([-1, n, None, str(path), fsum])
            else:
                entries.append([off, n, None])
        return [1, entries]

    def answer(self, op: str, args: list[Any]) -> Any:
        with self.lock:
            if op == "hello":
                return self.hello()
            if op == "reserve":
                return self.reserve(args[0], args[1])
            if op == "commit":
                return [0] * len(args[0])
            if op == "acquire":
                return self.acquire(args[0])
            if op == "exists":
                n = 0
                while n < len(args[0]) and args[0][n] in self.objects:
                    n += 1
                return n
            if op == "stats":
                return {"pid": os.getpid()}
            if op == "abort":
                return None
            return ["error", f"the fake does not know {op!r}"]

    def serve_one(self, conn: socket.socket) -> None:
        self.log("connection")
        try:
            with conn:
                while True:
                    try:
                        op, *args = wire.decode_request(_read(conn))
                    except (EOFError, OSError, ValueError):
                        return
                    self.log(op)
                    if op in ("release", "settle"):
                        continue
                    conn.sendall(wire.encode(self.answer(op, args)))
        finally:  # the client hung up: everything it sent is logged above this line
            self.log("closed")


def _read(conn: socket.socket) -> bytes:
    head = _exactly(conn, wire.HEADER.size)
    (n,) = wire.HEADER.unpack(head)
    return _exactly(conn, n)


def _exactly(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--lie", default="truthful")
    ap.add_argument("--socket", default=None)
    ap.add_argument("--tier", default=None)
    ap.add_argument("--outside", default="/etc/hostname")
    ap.add_argument("--capacity", type=int, default=8 << 20)
    ap.add_argument("--log", default=None)
    args = ap.parse_args()
    fake = Fake(args)
    path = args.socket or str(Path(args.runtime_dir) / f"{args.name}.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o666)  # reachable by whoever may traverse its directory
    srv.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=fake.serve_one, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
