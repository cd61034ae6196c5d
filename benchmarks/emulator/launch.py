"""Start and stop a fleet of emulated engines (:mod:`.server`) in a process of its own.

    with EmulatedFleet(EmulatorSpec(instances=8, tokenizer=".models/bench"), logs) as f:
        f.urls, f.specs   # base URLs; router instance entries (url, kv_events, replay)

:meth:`EmulatedFleet.stop` ends only the process group started here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.paths import module_command, module_env
from kvcentric.testing.servers import stop_group


@dataclass(frozen=True)
class EmulatorSpec:
    """How to start the emulator; ``ValueError`` on bad values. ``store``: a local store
    config (store hits through it), ``compute``: ``separate`` | ``shared`` | ``K``."""

    instances: int
    tokenizer: str
    profile: str = "vllm_cpu_bench"
    model: str = "bench"
    pages: int = 64
    max_model_len: int = 32768
    compute: str = "separate"
    slowdown: float = 1.0
    store: dict[str, Any] | None = None
    kv_events: bool = True
    cpus: tuple[int, ...] | None = None  # the emulator process's CPUs (None: any)
    dilation: float = 1.0  # every engine this many times slower (time-scaled emulation)
    discipline: str = "fair"  # how engines sharing a processor share it (.processors)
    interference: float = 1.0  # fair sharing: k in a step run at 1/(1 + x(k-1)) each
    host_interference: bool = False  # x per step from the profile's measured samples
    seed: int = 0  # seeds those draws
    kind: str = "vllm"  # whose formats the engines speak: vllm or sglang
    prefill_instances: int = 0  # sglang: the first P are prefill servers, the rest decode

    def __post_init__(self) -> None:
        if self.instances < 1 or self.pages < 1:
            raise ValueError("instances and pages must be >= 1")
        if self.kind not in ("vllm", "sglang"):
            raise ValueError(f"kind must be vllm or sglang, got {self.kind!r}")
        if self.prefill_instances and (self.kind != "sglang"
                                       or not 0 < self.prefill_instances < self.instances):
            raise ValueError("prefill_instances needs kind sglang and fewer than instances")
        if self.compute not in ("separate", "shared") and not self.compute.isdigit():
            raise ValueError(f"compute must be separate, shared or a group size, got "
                             f"{self.compute!r}")
        if self.slowdown < 1:
            raise ValueError("slowdown must be >= 1")
        if not self.dilation > 0:
            raise ValueError("dilation must be > 0")
        if not 0 <= self.interference < float("inf"):
            raise ValueError("interference must be >= 0")

    def args(self, fleet_file: Path) -> list[str]:
        out = ["--instances", str(self.instances), "--profile", self.profile,
               "--model", self.model, "--tokenizer", self.tokenizer,
               "--pages", str(self.pages), "--max-model-len", str(self.max_model_len),
               "--compute", self.compute, "--slowdown", str(self.slowdown),
               "--dilation", str(self.dilation), "--discipline", self.discipline,
               "--interference", str(self.interference), "--seed", str(self.seed),
               "--fleet-file", str(fleet_file), "--kind", self.kind,
               "--prefill-instances", str(self.prefill_instances)]
        if self.store is not None:
            out += ["--store", json.dumps(self.store)]
        if not self.kv_events:
            out.append("--no-kv-events")
        if self.host_interference:
            out.append("--host-interference")
        return out


class EmulatedFleet:
    def __init__(self, spec: EmulatorSpec, logs: Path, tag: str = "emulator") -> None:
        self.spec = spec
        self.logs = logs
        self.fleet_file = logs / f"{tag}-fleet.json"
        self.log = logs / f"{tag}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.specs: list[dict[str, Any]] = []

    @property
    def urls(self) -> list[str]:
        return [s["url"] for s in self.specs]

    def start(self, timeout_s: float = 120.0) -> EmulatedFleet:
        self.fleet_file.unlink(missing_ok=True)
        cpus = self.spec.cpus
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                module_command("benchmarks.emulator.server", *self.spec.args(self.fleet_file)),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=module_env(),
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        deadline = time.monotonic() + timeout_s
        while not self.fleet_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"emulator exited: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"emulator not up in {timeout_s} s; log {self.log}")
            time.sleep(0.2)
        self.specs = json.loads(self.fleet_file.read_text())
        for u in self.urls:
            r = httpx.get(u + "/health", timeout=10)
            r.raise_for_status()
        return self

    def stop(self) -> None:
        stop_group(self.proc, 10.0)

    def __enter__(self) -> EmulatedFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _get(self, path: str) -> list[Any]:
        with httpx.Client(timeout=30) as c:
            return [c.get(u + path).json() for u in self.urls]

    def stats(self, since: float = 0.0) -> list[dict[str, Any]]:
        """Every engine's ``/emulator/stats`` (the event loop's lateness since ``since``,
        a :func:`time.monotonic` time)."""
        return self._get(f"/emulator/stats?since={since}")

    def records(self) -> list[dict[str, Any]]:
        """Every finished request of every engine (``/emulator/requests``)."""
        return [r for recs in self._get("/emulator/requests") for r in recs]

    def use_store(self, enabled: bool) -> None:
        """Whether the engines look up and save in the fleet's store from now on
        (``POST /emulator/store``); without a store only ``False`` is accepted."""
        if self.spec.store is None:
            if enabled:
                raise ValueError("this fleet runs without a store")
            return
        with httpx.Client(timeout=30) as c:
            for u in self.urls:
                c.post(u + "/emulator/store", json={"enabled": enabled}).raise_for_status()

    def async_loads(self, flags: Sequence[bool]) -> None:
        """Which engines load store hits beside their steps from now on (one flag per
        engine, in order; ``POST /emulator/loads``)."""
        if len(flags) != len(self.urls):
            raise ValueError(f"{len(flags)} flags for {len(self.urls)} engines")
        with httpx.Client(timeout=30) as c:
            for u, on in zip(self.urls, flags, strict=True):
                c.post(u + "/emulator/loads", json={"async": on}).raise_for_status()

    def reset(self, timeout_s: float = 60.0) -> None:
        """Empty every engine's prefix cache (retried while requests still hold pages),
        then step each engine once with a one-token request (id ``flush/<i>``).

        Like vLLM, an engine publishes KV events only when it steps, so without the step
        its ``AllBlocksCleared`` would wait for its next request, and a router started
        meanwhile would replay the blocks it stored before the reset as resident: it
        predicts local hits the engine no longer has (and learns the instance is slow)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=30) as c:
            for u in self.urls:
                while c.post(u + "/reset_prefix_cache").status_code != 200:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{u}: prefix cache still in use")
                    time.sleep(0.2)
            for i, u in enumerate(self.urls):
                c.post(u + "/v1/completions", json={
                    "model": self.spec.model, "prompt": [1], "max_tokens": 1,
                    "ignore_eos": True}, headers={"x-request-id": f"flush/{i}"},
                ).raise_for_status()
