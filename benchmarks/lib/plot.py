"""PNG comparisons of loadgen result files: TTFT CDF and throughput/goodput bars.

    python -m benchmarks.lib.plot A.json B.json [...] --out PREFIX

writes ``PREFIX_ttft_cdf.png`` and ``PREFIX_throughput.png``; each result is labelled by
its ``label`` field (or its file name).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(results: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """One CDF line of successful requests' TTFT per result."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for res in results:
        xs = sorted(1e3 * r["ttft_s"] for r in res["requests"] if r["success"])
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{res['label']} (mean {sum(xs) / len(xs):.0f} ms)")
    slo = results[0]["config"].get("slo_ttft_ms") if results else None
    if slo:
        ax.axvline(slo, color="grey", linestyle="--", label=f"TTFT SLO {slo:.0f} ms")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log",
           title=title or "TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_bars(results: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Bars per result: request throughput and goodput (req/s), output throughput (tok/s)."""
    plt = _plt()
    labels = [r["label"] for r in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    xs = range(len(results))
    req = [r["summary"]["request_throughput"] for r in results]
    good = [r["summary"]["goodput"] or 0.0 for r in results]
    a1.bar([x - width / 2 for x in xs], req, width, label="request throughput")
    a1.bar([x + width / 2 for x in xs], good, width, label="goodput (within SLO)")
    a1.set(ylabel="requests / s", title="throughput and goodput",
           ylim=(0, 1.35 * max([*req, *good, 1e-9])))  # headroom for the legend
    a2.bar(list(xs), [r["summary"]["output_throughput"] for r in results], 0.6)
    a2.set(ylabel="output tokens / s", title="output token throughput")
    for ax in (a1, a2):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=15)
        ax.grid(axis="y", alpha=0.3)
    a1.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: Sequence[dict[str, Any]], prefix: Path, title: str = "") -> list[Path]:
    """Both figures, as ``<prefix>_ttft_cdf.png`` and ``<prefix>_throughput.png``."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    return [ttft_cdf(results, prefix.with_name(prefix.name + "_ttft_cdf.png"), title),
            throughput_bars(results, prefix.with_name(prefix.name + "_throughput.png"), title)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="output path prefix")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    results = []
    for path in args.results:
        doc = json.loads(path.read_text())
        doc.setdefault("label", path.stem)
        results.append(doc)
    for p in plot_all(results, args.out, args.title):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
