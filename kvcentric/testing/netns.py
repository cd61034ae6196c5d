"""A private network namespace with only loopback, for running Mooncake on one machine.

``mooncake_master``'s HTTP servers and every Mooncake client open listeners on all
interfaces whatever address they are given. Tests, benchmarks and demos therefore run them
inside a network namespace of their own (``unshare -n``, then ``ip link set lo up``): only
processes in that namespace can reach them. In production they must sit behind the
cluster's network policy instead.

:class:`NetNamespace` holds one such namespace with a sleeping process, and can run
commands in it (:meth:`NetNamespace.wrap`, via ``nsenter``) or move the calling *thread*
into it and back (:meth:`NetNamespace.entered`, via ``setns``): processes that thread
starts, and sockets it opens, are then inside. Needs ``CAP_SYS_ADMIN`` (root).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

CLONE_NEWNET = 0x40000000


def setns_net(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def unavailable_reason() -> str | None:
    """Why private network namespaces cannot be made here, or None when they can."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / iproute2)"
    try:
        out = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -n failed: {exc}"
    if out.returncode != 0:
        return f"unshare -n failed (needs CAP_SYS_ADMIN): {out.stderr.strip()}"
    return None


class NetNamespace:
    """A network namespace (loopback only), alive until :meth:`stop`."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> NetNamespace:
        self.proc = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && echo ready && exec sleep infinity"],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError("could not create a network namespace (unshare -n needs root)")
        return self

    @property
    def path(self) -> str:
        assert self.proc is not None, "start() first"
        return f"/proc/{self.proc.pid}/ns/net"

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed to run inside the namespace."""
        return ["nsenter", f"--net={self.path}", "--", *cmd]

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the calling thread inside the namespace for the ``with`` block."""
        old = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        new = os.open(self.path, os.O_RDONLY)
        try:
            setns_net(new)
            try:
                yield
            finally:
                setns_net(old)
        finally:
            os.close(new)
            os.close(old)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> NetNamespace:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
