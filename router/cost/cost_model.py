"""Predicted prefill, load and decode times (Mooncake FAST'25, Algorithm 1).

Prefill FLOPs of ``n`` prompt tokens grow as ``a·n² + b·n`` (attention is quadratic,
everything else linear). With the first ``h`` tokens' KV reused, only tokens ``h..n`` are
computed, each attending to everything before it, so::

    T_prefill(n, h) = a·(n² − h²) + b·(n − h) + c

``c`` is the fixed cost of one engine step. vLLM always recomputes the last prompt token,
so ``h`` is capped at ``n − 1``. :func:`fit` finds ``a, b, c >= 0`` from measured points
(``kvcentric-router profile``). Times are seconds throughout.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcentric.stored_layout import dtype_itemsize

KV_FULL = 0.98  # KV usage beyond which the engine preempts: a decode there breaks any TBT SLO


@dataclass(frozen=True)
class Profile:
    """A per-model cost profile.

    ``a`` (s/token²), ``b`` (s/token), ``c`` (s): the prefill fit. ``tbt_base_s`` and
    ``tbt_per_seq_s``: time per output token at batch size 1 and its growth per running
    sequence. ``store_bandwidth_bps``: measured store read bandwidth (bytes/s) or ``None``;
    ``disk_bandwidth_bps``: measured cold-read bandwidth of the store's disk tier (bytes/s,
    :mod:`kvcentric.disk_probe`) or ``None``.
    """

    a: float = 1e-9
    b: float = 1e-4
    c: float = 0.01
    tbt_base_s: float = 0.02
    tbt_per_seq_s: float = 0.001
    store_bandwidth_bps: float | None = None
    disk_bandwidth_bps: float | None = None
    model: str = ""
    r2: float | None = None
    points: tuple[tuple[int, int, float], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "tbt_base_s", "tbt_per_seq_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
                raise ValueError(f"profile.{name} must be a finite number >= 0, got {v!r}")
        for name in ("store_bandwidth_bps", "disk_bandwidth_bps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not 0 < v < math.inf):
                raise ValueError(f"profile.{name} must be > 0, got {v!r}")

    def prefill_s(self, n: int, hit: int = 0) -> float:
        """Predicted prefill time of an ``n``-token prompt whose first ``hit`` tokens are
        reused."""
        if n <= 0:
            return 0.0
        h = min(max(hit, 0), n - 1)
        return self.a * (n * n - h * h) + self.b * (n - h) + self.c

    def tbt_s(self, batch: int, kv_usage: float = 0.0) -> float:
        """Predicted time per output token with ``batch`` sequences running (this request
        included); infinite when the KV cache is nearly full (preemption)."""
        if kv_usage >= KV_FULL:
            return math.inf
        return self.tbt_base_s + self.tbt_per_seq_s * max(batch - 1, 0)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["points"] = [list(p) for p in self.points]
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Profile:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown profile fields {sorted(unknown)}")
        raw = dict(raw)
        raw["points"] = tuple(tuple(p) for p in raw.get("points", ()))
        return cls(**raw)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read profile {path}: {exc}") from exc
        return cls.from_json(raw)


def _features(n: np.ndarray, h: np.ndarray) -> np.ndarray:
    h = np.minimum(h, n - 1)
    return np.stack([n * n - h * h, n - h, np.ones_like(n)], axis=1).astype(np.float64)


def fit(points: Sequence[tuple[int, int, float]], **extra: Any) -> Profile:
    """Least-squares ``a, b, c >= 0`` over measured ``(n, hit, seconds)`` points.

    Non-negativity is enforced by trying every subset of the three terms and keeping the
    best fit whose coefficients are all >= 0 (exact for three unknowns).
    """
    if len(points) < 3:
        raise ValueError(f"need at least 3 points to fit, got {len(points)}")
    arr = np.asarray(points, dtype=np.float64)
    x = _features(arr[:, 0], arr[:, 1])
    y = arr[:, 2]
    best: tuple[float, np.ndarray] | None = None
    for k in (1, 2, 3):
        for cols in itertools.combinations(range(3), k):
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(cols)] = coef
            sse = float(((x @ full - y) ** 2).sum())
            if best is None or sse < best[0]:
                best = (sse, full)
    assert best is not None  # the constant-only fit of positive times is always >= 0
    sst = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - best[0] / sst if sst > 0 else 1.0
    a, b, c = (float(v) for v in best[1])
    pts = tuple((int(p[0]), int(p[1]), float(p[2])) for p in points)
    return Profile(a=a, b=b, c=c, r2=r2, points=pts, **extra)


def load_s(num_bytes: float, bandwidth_bps: float) -> float:
    """Time to move ``num_bytes`` at ``bandwidth_bps``."""
    return num_bytes / bandwidth_bps if num_bytes > 0 else 0.0


def tiered_load_s(dram_bytes: float, disk_bytes: float, dram_bps: float,
                  disk_bps: float) -> float:
    """Time to load ``dram_bytes`` from the store's DRAM tier and ``disk_bytes`` from its
    disk tier: ``dram_bytes / dram_bps + disk_bytes / disk_bps``."""
    return load_s(dram_bytes, dram_bps) + load_s(disk_bytes, disk_bps)


def kv_bytes_per_token(model_dir: str | Path, kv_dtype: str | None = None) -> int:
    """KV bytes one token occupies across all layers (K and V), from ``config.json``.

    ``kv_dtype`` ``None`` uses the checkpoint's ``torch_dtype``.
    """
    cfg_path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {cfg_path} to size the KV cache: {exc}") from exc
    cfg = cfg.get("text_config", cfg)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    dtype = (kv_dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
    return 2 * layers * kv_heads * head_dim * dtype_itemsize(dtype)
