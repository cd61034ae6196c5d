"""Who may use a local coordinator, and for what: its peers, its admin token and pin caps.

Contract (docs/store.md §Shared host):

- **Peers.** Every connection is checked once, at accept, with ``SO_PEERCRED``: a process
  of the coordinator's own user, or of its ``peer_group`` (primary or supplementary group),
  stays; any other is closed before a byte of it is read (:meth:`Gate.admit`).
- **The admin token.** At start the coordinator writes a random 256-bit token to
  ``{name}.token`` next to its socket, mode ``0600`` (created ``O_EXCL``, never through a
  symlink). A connection that presents it (``["auth", token]``) is an admin connection.
  Admin operations are :data:`ADMIN_OPS` (clear, shutdown) and soft pins longer than
  ``max_pin_s``. Such a request from a connection without the token, or a wrong token, is
  answered with an error naming the token's path, and the connection is then closed.
  ``kvcentric store stop`` and :func:`kvcentric.store.local.launcher.stop` read the token;
  so does the local client for ``clear`` and long pins. A ``peer_group`` member cannot
  read it, so it can use the store but not clear it, stop it or pin for long.
- **Pin caps.** A pin of more than ``MAX_PIN_S`` is refused for everyone; the bytes one
  connection holds pinned are capped by the index (``pinned_bytes_cap``).
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
from typing import Any

from kvcentric.config import StoreConfig
from kvcentric.store.local import trust
from kvcentric.store.local.config import MAX_PIN_S, token_path

ADMIN_OPS = frozenset({"clear", "shutdown"})
TOKEN_BYTES = 32


class Forbidden(Exception):
    """A request its connection may not make: answered with an error, then the
    connection is closed."""


def write_token(cfg: StoreConfig) -> str:
    """Write a fresh admin token for this coordinator (the previous one, of a dead
    coordinator, is replaced); returns it."""
    token = secrets.token_hex(TOKEN_BYTES)
    try:
        os.unlink(token_path(cfg))
    except FileNotFoundError:
        pass
    fd = trust.open_file(token_path(cfg), os.O_WRONLY, "the store's admin token", new=True,
                         mode=0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return token


def read_token(cfg: StoreConfig) -> str:
    """The admin token of ``cfg``'s coordinator; ``Untrusted`` if the file is a symlink,
    not ours or readable by others, ``OSError`` if it cannot be read."""
    fd = trust.open_file(token_path(cfg), os.O_RDONLY, "the store's admin token")
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            raise trust.Untrusted(f"refusing the store's admin token {str(token_path(cfg))!r}: "
                                  f"other users may read it ({trust.describe(st)})")
        return os.read(fd, 4 * TOKEN_BYTES).decode(errors="replace").strip()
    finally:
        os.close(fd)


class Gate:
    """The coordinator's checks of its peers and their requests."""

    def __init__(self, cfg: StoreConfig, token: str) -> None:
        self.cfg = cfg
        self.gid = cfg.local.peer_gid
        self._token = token.encode()
        self.refused_peers = 0

    def admit(self, sock: socket.socket) -> str | None:
        """None when the peer on ``sock`` may stay; else why it must be dropped."""
        try:
            why = trust.peer_refusal(sock, self.gid)
        except OSError as exc:
            why = f"its credentials cannot be read: {exc}"
        if why is not None:
            self.refused_peers += 1
        return why

    def auth(self, token: str) -> None:
        """``Forbidden`` unless ``token`` is this coordinator's."""
        if not hmac.compare_digest(token.encode(errors="replace"), self._token):
            raise Forbidden(f"wrong admin token (it is in {token_path(self.cfg)})")

    def check(self, admin: bool, op: str, args: tuple[Any, ...]) -> None:
        """``Forbidden`` when ``op`` with ``args`` needs the admin token and the connection
        did not present it; ``ValueError`` for a pin nobody may have."""
        if op == "commit":
            pin_s = args[2]
            if not 0 <= pin_s <= MAX_PIN_S:
                raise ValueError(f"commit: a pin outside [0, {MAX_PIN_S}] s")
            if pin_s > self.cfg.local.max_pin_s and not admin:
                raise Forbidden(f"a pin of {pin_s:g} s (over max_pin_s = "
                                f"{self.cfg.local.max_pin_s:g} s) needs the store's admin token "
                                f"({token_path(self.cfg)})")
        elif op in ADMIN_OPS and not admin:
            raise Forbidden(f"{op!r} needs the store's admin token ({token_path(self.cfg)})")
