"""Measure a running instance and fit the router's cost profile.

Prefill: for every (prompt length ``n``, hit fraction ``f``) the instance first computes a
fresh random prefix of ``h = f·n`` tokens (rounded down to whole pages), then the timed
request sends that prefix plus fresh tokens up to ``n`` with ``max_tokens=1``; its latency
is ``T_prefill(n, h)`` (plus one decode step, inside the fit's constant). Fresh random
token ids per point mean nothing else is cached. TBT: mean gap between streamed tokens at
batch 1 and at a small batch gives the base and per-sequence slope.

Store bandwidth (optional, instances with the kvcentric connector): after a prompt was
computed, ``/reset_prefix_cache`` (vLLM dev mode) drops it from the engine, so the next
run loads it from the store; (T_store_hit − T_local_hit) over the bytes of its full blocks
is the tier's effective bandwidth.

Disk bandwidth (optional, a local store with a disk tier): engines cannot be made to read
from the disk tier on demand, so :func:`disk_bandwidth` measures what bounds a disk hit,
a cold sequential read on the tier's own file system
(:func:`kvcentric.disk_probe.cold_read`), and records it only when the read
really reached a block device (a tmpfs or page-cache read would promise memory speed).
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kvcentric.disk_probe import cold_read
from kvcentric.router.cost.cost_model import Profile, fit

log = logging.getLogger("kvcentric.router.cost.profile")


class Profiler:
    def __init__(self, url: str, model: str, *, page: int = 128, vocab: int = 1000,
                 seed: int = 0, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.page = page
        self.vocab = vocab
        self.rnd = random.Random(seed)
        self.client = httpx.Client(timeout=timeout_s)

    def models(self) -> list[str]:
        """The model names ``/v1/models`` lists; ``ValueError`` naming the URL when the
        engine cannot be reached or answers something else."""
        try:
            r = self.client.get(self.url + "/v1/models", timeout=10.0)
            r.raise_for_status()
            return [str(m.get("id")) for m in r.json().get("data") or []
                    if isinstance(m, dict)]
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot reach the engine at {self.url}: {_why(exc)}") from exc
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{self.url}/v1/models is not an OpenAI model list: "
                             f"{exc}") from exc

    def fresh(self, n: int) -> list[int]:
        return [self.rnd.randrange(10, self.vocab) for _ in range(n)]

    def complete(self, prompt: Sequence[int], max_tokens: int = 1) -> float:
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        r = self.client.post(self.url + "/v1/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - t0

    def prefill_points(self, lengths: Sequence[int], hits: Sequence[float],
                       repeats: int) -> list[tuple[int, int, float]]:
        self.complete(self.fresh(64))  # warm-up: first requests pay one-off costs
        points = []
        for n in lengths:
            for f in hits:
                h = int(n * f) // self.page * self.page
                times = []
                for _ in range(repeats):
                    prefix = self.fresh(h)
                    if h:
                        self.complete(prefix)
                    times.append(self.complete(prefix + self.fresh(n - h)))
                points.append((n, h, statistics.median(times)))
        return points

    async def _stream_gaps(self, client: httpx.AsyncClient, n_out: int) -> list[float]:
        body = {"model": self.model, "prompt": self.fresh(32), "max_tokens": n_out,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        stamps: list[float] = []
        async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # skip the prefill gap

    async def _tbt(self, batch: int, n_out: int) -> float:
        async with httpx.AsyncClient(timeout=600) as client:
            gaps = await asyncio.gather(*(self._stream_gaps(client, n_out)
                                          for _ in range(batch)))
        flat = [g for gs in gaps for g in gs]
        return statistics.median(flat) if flat else 0.0

    def tbt(self, batch: int = 4, n_out: int = 32) -> tuple[float, float]:
        base = asyncio.run(self._tbt(1, n_out))
        loaded = asyncio.run(self._tbt(batch, n_out))
        return base, max(0.0, (loaded - base) / (batch - 1))

    def store_bandwidth(self, n: int, kv_bytes_per_token: int, block: int,
                        repeats: int) -> float | None:
        """Effective store read bandwidth (bytes/s), or None when it cannot be resolved."""
        diffs = []
        for _ in range(repeats):
            p = self.fresh(n)
            self.complete(p)  # computed; the connector stores its full blocks
            self.client.post(self.url + "/reset_prefix_cache").raise_for_status()
            t_store = self.complete(p)
            t_local = self.complete(p)
            diffs.append(t_store - t_local)
        d = statistics.median(diffs)
        nbytes = (n - 1) // block * block * kv_bytes_per_token
        return nbytes / d if d > 0 and nbytes > 0 else None

    def close(self) -> None:
        self.client.close()


MIN_DEVICE_FRACTION = 0.5  # of the probe's bytes fetched from the device, to count


def disk_bandwidth(path: Path, nbytes: int, reps: int = 3) -> float | None:
    """Cold-read bandwidth (bytes/s) of the disk tier's directory ``path``; None (with a
    warning) when the read did not reach a block device. OSError when ``path`` is not a
    writable directory with room for ``nbytes``."""
    cold = cold_read(path, nbytes, reps=reps)
    if cold.device_fraction < MIN_DEVICE_FRACTION:
        log.warning("disk probe in %s read %.0f%% of its bytes from a device (tmpfs or "
                    "cached?): disk bandwidth not recorded", path, cold.device_fraction * 100)
        return None
    return cold.bandwidth_bps


def _why(exc: httpx.HTTPError) -> str:
    """``exc`` in words: the status of an HTTP error answer, else the transport's reason."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.request.method} {exc.request.url.path} answered " \
               f"{exc.response.status_code}: {exc.response.text[:200]}"
    return str(exc) or type(exc).__name__


def run_profile(url: str, model: str, *, lengths: Sequence[int], hits: Sequence[float],
                repeats: int = 2, page: int = 128, kv_bytes_per_token: int | None = None,
                block_size: int = 256, store_n: int = 0, disk_path: Path | None = None,
                disk_probe_bytes: int = 256 << 20) -> Profile:
    """Measure ``url`` (and the disk tier at ``disk_path``) and return the fitted profile
    (see the module docstring). ``ValueError`` naming ``url`` when it is no engine URL,
    cannot be reached, does not serve ``model``, or fails while measured."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url!r} must be an engine's http://HOST:PORT")
    prof = Profiler(url, model, page=page)
    try:
        served = prof.models()
        if model not in served:
            raise ValueError(f"the engine at {url} serves {served}, not {model!r} (--model)")
        points = prof.prefill_points(lengths, hits, repeats)
        tbt_base, tbt_slope = prof.tbt()
        bw = None
        if store_n and kv_bytes_per_token:
            bw = prof.store_bandwidth(store_n, kv_bytes_per_token, block_size, repeats)
    except httpx.HTTPError as exc:
        raise ValueError(f"profiling the engine at {url} failed: {_why(exc)}") from exc
    finally:
        prof.close()
    disk = disk_bandwidth(disk_path, disk_probe_bytes, repeats) if disk_path else None
    extra: dict[str, Any] = {"model": model, "tbt_base_s": tbt_base, "tbt_per_seq_s": tbt_slope,
                             "store_bandwidth_bps": bw, "disk_bandwidth_bps": disk}
    return fit(points, **extra)
