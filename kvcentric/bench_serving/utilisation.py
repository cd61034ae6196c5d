"""Each instance's load over a run, sampled from its Prometheus ``/metrics``.

A :class:`Sampler` thread reads every URL's gauges every ``interval_s``: requests running,
requests waiting and KV-cache usage (vLLM's or SGLang's names, :data:`GAUGES`). Over the
timed run, :func:`summarise` gives per instance:

- ``busy_fraction``: the share of samples with at least one request running or waiting;
- ``running_mean``, ``waiting_mean``, ``waiting_max``; ``kv_usage_mean``/``_max`` (0..1);

and across instances ``load_imbalance``: the busiest instance's mean load (running +
waiting) over the mean of all instances' (1.0: perfectly even; None when all were idle).
A sample the server did not answer, or a gauge it does not expose, is ``None`` and left
out of that statistic. (The repository's ``benchmarks.serving.utilisation`` draws them.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .scrape import parse

if TYPE_CHECKING:
    import httpx

GAUGES = {  # our name -> metric names, the first one exposed wins
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
}
SERIES = ("t_s", *GAUGES)


def gauges(metrics: dict[str, float] | None) -> dict[str, float | None]:
    """Our gauges from parsed ``/metrics`` (None where absent or not answered)."""
    out: dict[str, float | None] = {}
    for key, names in GAUGES.items():
        out[key] = next((metrics[n] for n in names if metrics and n in metrics), None)
    return out


class Sampler:
    """Samples every URL's gauges every ``interval_s`` on a daemon thread while entered.

    Entering returns once the first round of samples is in (or ``timeout_s`` has passed):
    the thread's start and its HTTP client's set-up then fall before the caller's run, so
    even a run of a fraction of a second on a loaded machine is sampled from its start.
    ``samples[url]`` holds one list per :data:`SERIES` entry; ``t_s`` is
    ``time.perf_counter()`` at the sample.
    """

    def __init__(self, urls: Sequence[str], interval_s: float = 0.5,
                 timeout_s: float = 5.0) -> None:
        if interval_s <= 0:
            raise ValueError("the sampling interval must be > 0")
        self.urls, self.interval_s, self.timeout_s = list(urls), interval_s, timeout_s
        self.samples: dict[str, dict[str, list[float | None]]] = {
            u: {k: [] for k in SERIES} for u in self.urls}
        self._stop = threading.Event()
        self._first_round = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        self._first_round.wait(self.timeout_s * max(1, len(self.urls)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                for url in self.urls:
                    self._sample(client, url)
                self._first_round.set()
                self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t)))

    def _sample(self, client: httpx.Client, url: str) -> None:
        import httpx

        t = time.perf_counter()
        try:
            r = client.get(url.rstrip("/") + "/metrics")
            values = gauges(parse(r.text) if r.status_code == 200 else None)
        except httpx.HTTPError:
            values = gauges(None)
        row = self.samples[url]
        row["t_s"].append(t)
        for k, v in values.items():
            row[k].append(v)

    def window(self, t0: float, t1: float) -> dict[str, dict[str, list[float | None]]]:
        """The samples taken in ``[t0, t1]`` (perf_counter), times made relative to ``t0``."""
        out = {}
        for url, row in self.samples.items():
            keep = [i for i, t in enumerate(row["t_s"]) if t is not None and t0 <= t <= t1]
            out[url] = {k: [row[k][i] for i in keep] for k in GAUGES}
            out[url] = {"t_s": [round(float(row["t_s"][i] or 0) - t0, 3) for i in keep],
                        **out[url]}
        return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def instance_stats(row: dict[str, list[float | None]]) -> dict[str, Any]:
    """One instance's statistics from its samples (see the module docstring)."""
    run = [v for v in row["running"] if v is not None]
    wait = [v for v in row["waiting"] if v is not None]
    load = [r + w for r, w in zip(row["running"], row["waiting"])
            if r is not None and w is not None]
    kv = [v for v in row["kv_usage"] if v is not None]
    return {"samples": len(row["t_s"]), "answered": len(load),
            "busy_fraction": _mean([float(x > 0) for x in load]),
            "load_mean": _mean(load), "running_mean": _mean(run),
            "waiting_mean": _mean(wait), "waiting_max": max(wait, default=None),
            "kv_usage_mean": _mean(kv), "kv_usage_max": max(kv, default=None)}


def summarise(samples: dict[str, dict[str, list[float | None]]],
              interval_s: float) -> dict[str, Any]:
    """``per_instance`` statistics (in ``samples``' order) and ``load_imbalance``."""
    per = {url: instance_stats(row) for url, row in samples.items()}
    loads = [s["load_mean"] for s in per.values() if s["load_mean"] is not None]
    avg = _mean(loads)
    return {"interval_s": interval_s, "per_instance": per,
            "load_imbalance": max(loads) / avg if avg else None}


def format_table(util: dict[str, Any]) -> str:
    """A text table: one line per instance."""
    lines = [f"{' Instance utilisation ':=^50}",
             "instance  busy  running  waiting (max)  KV usage (max)"]
    for i, s in enumerate(util["per_instance"].values()):
        lines.append(f"{i:<8} {_pct(s['busy_fraction']):>5} {_num(s['running_mean']):>8} "
                     f"{_num(s['waiting_mean']):>8} ({_num(s['waiting_max'], '.0f')})"
                     f"  {_pct(s['kv_usage_mean']):>6} ({_pct(s['kv_usage_max'])})")
    lines.append(f"load imbalance (max / mean): {_num(util['load_imbalance'])}")
    return "\n".join(lines)


def _num(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"
