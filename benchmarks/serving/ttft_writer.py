"""What saving costs a miss (0% hit): ``python -m benchmarks.serving.ttft --writer``.

Per prompt length, each of ``runs`` rounds starts fresh servers of every arm (``plain``: no
connector; ``kvc``: ours on a local store; ``lmcache`` when its venv is set up), warms each
with a 32-token request that saves nothing, then sends

- **first**: one ``n``-token prompt to every arm, back to back (the fresh instance's first
  saving request; the same prompt everywhere, so every arm computes exactly the same);
- **steady**: ``reps`` more prompts, each to every arm back to back,

arms in an order that rotates with the round and the prompt, each request timed once
every arm's processes are quiet (``bench_ttft.Clock``: an engine polls for about a second
after a request, on the cores every arm's engine is pinned to). A connector arm's overhead is
the median over rounds of its *paired* ratio to ``plain`` minus 1 (a round's steady ratio
is the median over its prompts). Paired requests run seconds apart, so the shared box's
slow drifts, which move a whole round's TTFTs by +-10%, cancel; the ratio of the arms'
medians (this benchmark's earlier definition) is kept as ``*_overhead_unpaired``.
Each connector arm's saves are read from its own accounting (:mod:`benchmarks.serving.work`:
ours from our connector's counters, LMCache's from the ``lmcache server``'s), and an arm
that saved nothing in any round is marked invalid (``<arm>_invalid``) and left out of the
table, so a writer that saved nothing cannot pass for a cheap one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.serving.work import Work, invalid
from kvcentric.testing.servers import VllmServer

PHASES = ("first", "steady")


@dataclass
class RoundTimes:
    """One fresh round: per arm, the first request's seconds and each steady prompt's."""

    first: dict[str, float] = field(default_factory=dict)
    steady: dict[str, list[float]] = field(default_factory=dict)
    work: dict[str, Work] = field(default_factory=dict)  # per connector arm, this round's
    quiesce_s: list[float] = field(default_factory=list)  # the waits before each request


def rotated(names: Sequence[str], k: int) -> list[str]:
    """``names`` starting at position ``k`` (mod its length)."""
    k %= len(names)
    return [*names[k:], *names[:k]]


def time_round(servers: dict[str, VllmServer], prompts: list[list[int]], turn: int,
               ttft: Callable[[VllmServer, list[int]], float],
               work: Mapping[str, Callable[[], Work]], bar: tqdm | None = None) -> RoundTimes:
    """Send ``prompts[0]`` (first) then each later prompt (steady) to every arm, back to
    back, the arms' order rotating with ``turn`` and the prompt; ``work`` reads each
    connector arm's own counters, before and after."""
    names = list(servers)
    before = {n: read() for n, read in work.items()}
    out = RoundTimes(steady={n: [] for n in names})
    for i, prompt in enumerate(prompts):
        for name in rotated(names, turn + i):
            t = ttft(servers[name], prompt)
            if i == 0:
                out.first[name] = t
            else:
                out.steady[name].append(t)
            if bar is not None:
                bar.update(1)
    out.work = {n: work[n]() - b for n, b in before.items()}
    return out


def _q(xs: Sequence[float], q: float) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[int(4 * q) - 1] if len(xs) > 1 \
        else xs[0]


def paired_ratios(rounds: Sequence[RoundTimes], arm: str, phase: str) -> list[float]:
    """Per round, ``arm``'s TTFT over ``plain``'s (steady: the median over its prompts)."""
    if phase == "first":
        return [r.first[arm] / r.first["plain"] for r in rounds]
    return [statistics.median(a / p for a, p in zip(r.steady[arm], r.steady["plain"]))
            for r in rounds]


def overheads(rounds: Sequence[RoundTimes], n: int) -> dict[str, Any]:
    """The row for prompt length ``n``: every arm's raw TTFTs (ms), each connector arm's
    paired overhead per phase (median, quartiles, per round) and the unpaired one."""
    arms = list(rounds[0].first)
    row: dict[str, Any] = {"prompt_len": n, "runs": len(rounds)}
    for arm in arms:
        row[f"{arm}_first_ms"] = [1e3 * r.first[arm] for r in rounds]
        row[f"{arm}_steady_ms"] = [1e3 * statistics.median(r.steady[arm]) for r in rounds]
    for arm in (a for a in arms if a != "plain"):
        for phase in PHASES:
            ratios = paired_ratios(rounds, arm, phase)
            row[f"{arm}_{phase}_overhead"] = statistics.median(ratios) - 1
            row[f"{arm}_{phase}_overhead_q1_q3"] = [_q(ratios, 0.25) - 1, _q(ratios, 0.75) - 1]
            row[f"{arm}_{phase}_overhead_rounds"] = [x - 1 for x in ratios]
            row[f"{arm}_{phase}_overhead_unpaired"] = (
                statistics.median(row[f"{arm}_{phase}_ms"])
                / statistics.median(row[f"plain_{phase}_ms"]) - 1)
        if arm in rounds[0].work:
            done = [r.work[arm] for r in rounds]
            row[f"{arm}_saved"] = [w.saved for w in done]
            row[f"{arm}_saved_unit"], row[f"{arm}_work_source"] = done[0].unit, done[0].source
            why = next((w for w in (invalid(d, saves=True, loads=False) for d in done) if w),
                       None)
            if why is not None:
                row[f"{arm}_invalid"] = f"a round {why}: its overhead is not a writer's"
    waits = [w for r in rounds for w in r.quiesce_s]
    row["quiesce_s_median_max"] = [statistics.median(waits), max(waits)] if waits else None
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per length and connector arm: paired overhead (quartiles) per phase."""
    lines = [f"{'tokens':>7} {'arm':>8} {'first request':>24} {'steady state':>24} "
             f"{'unpaired first/steady':>22}"]
    for r in rows:
        for arm in ("kvc", "lmcache"):
            if f"{arm}_first_overhead" not in r:
                continue
            if f"{arm}_invalid" in r:
                lines.append(f"{r['prompt_len']:>7} {arm:>8} INVALID: {r[f'{arm}_invalid']}")
                continue
            cells = []
            for phase in PHASES:
                q1, q3 = r[f"{arm}_{phase}_overhead_q1_q3"]
                cells.append(f"{100 * r[f'{arm}_{phase}_overhead']:+6.1f}% "
                             f"[{100 * q1:+5.1f},{100 * q3:+5.1f}]")
            unp = "/".join(f"{100 * r[f'{arm}_{p}_overhead_unpaired']:+.1f}%" for p in PHASES)
            lines.append(f"{r['prompt_len']:>7} {arm:>8} {cells[0]:>24} {cells[1]:>24} "
                         f"{unp:>22}")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path, bars: dict[int, float]) -> Path:
    """Each round's paired overhead per length, arm and phase, the median marked, and
    the issue's bar per length (``bars``: prompt length -> max overhead) as a line."""
    from benchmarks.lib.plot import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4), squeeze=False)
    for ax, r in zip(axes[0], rows):
        labels, x = [], 0
        for arm in ("kvc", "lmcache"):
            for phase in PHASES:
                key = f"{arm}_{phase}_overhead"
                if key not in r or f"{arm}_invalid" in r:
                    continue
                ys = [100 * v for v in r[f"{key}_rounds"]]
                ax.scatter([x] * len(ys), ys, alpha=0.6, color="C0" if arm == "kvc" else "C1")
                ax.hlines(100 * r[key], x - 0.3, x + 0.3, color="k")
                labels.append(f"{arm}\n{phase}")
                x += 1
        if r["prompt_len"] in bars:
            ax.axhline(100 * bars[r["prompt_len"]], color="r", ls="--", lw=1, label="bar")
            ax.legend(loc="upper right")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set(title=f"{r['prompt_len']} tokens, {r['runs']} fresh rounds",
               ylabel="TTFT over no connector (%)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("writer overhead at 0% hit: paired per round (dots), median (line)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
