"""Box plots of each instance's load over a run (the repository's figures).

The samples and their summary come from :mod:`kvcentric.bench_serving.utilisation`;
:func:`boxes` draws one box per instance per arm, from result documents that carry
``utilisation_samples``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def boxes(results: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """One box per instance per arm: requests in the engine, and KV-cache usage.

    ``results`` are bench_serving result documents with ``utilisation_samples``.
    """
    from benchmarks.lib.plot import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 1.2 * _count(results) + 3), 4))
    for ax, key, label in ((axes[0], "load", "requests running + waiting"),
                           (axes[1], "kv_usage", "KV-cache usage (%)")):
        data, names, pos, x = [], [], [], 0.0
        for res in results:
            for i, row in enumerate(res.get("utilisation_samples", {}).values()):
                data.append(_series(row, key))
                names.append(f"{res['label']}\ninst {i}")
                pos.append(x)
                x += 1
            x += 0.6  # a gap between arms
        if data:
            ax.boxplot(data, positions=pos, widths=0.6)
            ax.set_xticks(pos)
            ax.set_xticklabels(names, fontsize=7)
        ax.set(ylabel=label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or "per-instance load over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _count(results: Sequence[dict[str, Any]]) -> int:
    return sum(len(r.get("utilisation_samples", {})) for r in results)


def _series(row: dict[str, list[float | None]], key: str) -> list[float]:
    if key == "load":
        return [r + w for r, w in zip(row["running"], row["waiting"])
                if r is not None and w is not None]
    return [100 * v for v in row[key] if v is not None]
