"""An emulated engine's timing: one step of continuous batching as a function of its batch.

vLLM runs one *step* at a time: every decoding sequence contributes one token and waiting
prefills fill the rest of a token budget (``max_num_batched_tokens``, chunked prefill).
The emulator times a step as::

    T_step = step_s
           + prefill_token_s * (prompt tokens computed in the step)
           + prefill_pair_s  * (attention pairs of those tokens: chunk * (context + chunk/2))
           + decode_seq_s    * (sequences decoding in the step)
           + decode_ctx_s    * (context tokens those sequences attend to)

and adds ``api_s`` once per request before it reaches the scheduler (HTTP, tokenising,
detokenising: the API server's work, off the engine's processor). A request's TTFT is
then ``api_s`` + its wait + the steps up to the end of the one that computes its last
prompt token; its inter-token latency is the step time. Hits (engine prefix cache or a
store load) remove prompt tokens from the steps; a store load adds ``bytes / bandwidth``
to the step that admits it (vLLM CPU loads synchronously).

:func:`fit` finds the coefficients (all >= 0) from measured single-request TTFTs over
(prompt length, cached tokens) and measured inter-token latencies over batch sizes
(:mod:`benchmarks.emulator.measure`). Profiles are JSON files under
``benchmarks/emulator/profiles/``; :func:`load` reads one by name or path.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

PROFILES = Path(__file__).with_name("profiles")
COEFFS = ("api_s", "step_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s",
          "decode_ctx_s")


@dataclass(frozen=True)
class EngineProfile:
    """One engine's timing and shape; ``ValueError`` on a bad value.

    ``page_size``: tokens per KV page (vLLM CPU 128, GPU 16); ``max_num_batched_tokens``
    and ``max_num_seqs``: vLLM's scheduler limits; ``kv_bytes_per_token``: K and V of
    every layer (store load sizes); ``store_bandwidth_bps``: the store's load bandwidth
    (bytes/s); ``shared_handoff_s``: how long engines of this kind sharing one processor
    keep it after their last step (:class:`.processors.ExclusiveProcessor`);
    ``host_interference``: how much engines of this kind on one host, each computing on a
    processor of its own, slow each other: with ``k`` of them in a step, each step takes
    ``1 + host_interference * (k - 1)`` times as long (0: separate machines, as GPUs;
    :class:`.processors.Processor` with ``interference``), the mean of
    ``host_interference_samples``, each a measured step's (the emulator draws from them
    per step); ``source``: how the numbers were obtained (a command, or the
    publications).
    """

    name: str
    source: str
    api_s: float
    step_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_ctx_s: float
    page_size: int = 128
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    kv_bytes_per_token: int = 16384
    store_bandwidth_bps: float = 5e9
    shared_handoff_s: float = 0.0
    host_interference: float = 0.0
    host_interference_samples: tuple[float, ...] = ()
    fit: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in COEFFS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v >= 0):
                raise ValueError(f"profile {self.name}: {name} must be a finite number >= 0, "
                                 f"got {v!r}")
        for name in ("page_size", "max_num_batched_tokens", "max_num_seqs",
                     "kv_bytes_per_token"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"profile {self.name}: {name} must be an integer >= 1, "
                                 f"got {v!r}")
        if not (isinstance(self.store_bandwidth_bps, (int, float))
                and 0 < self.store_bandwidth_bps < math.inf):
            raise ValueError(f"profile {self.name}: store_bandwidth_bps must be > 0")
        if not (isinstance(self.shared_handoff_s, (int, float))
                and 0 <= self.shared_handoff_s < math.inf):
            raise ValueError(f"profile {self.name}: shared_handoff_s must be >= 0")
        if isinstance(self.host_interference, bool) or not (
                isinstance(self.host_interference, (int, float))
                and 0 <= self.host_interference < math.inf):
            raise ValueError(f"profile {self.name}: host_interference must be >= 0")
        samples = tuple(self.host_interference_samples)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                   and 0 <= x < math.inf for x in samples):
            raise ValueError(f"profile {self.name}: host_interference_samples must be "
                             f"numbers >= 0")
        object.__setattr__(self, "host_interference_samples", samples)  # JSON gives a list
        if self.step_s + self.prefill_token_s + self.decode_seq_s <= 0:
            raise ValueError(f"profile {self.name}: a step must take some time")

    # ---- timing ----
    def step_time(self, chunks: Sequence[tuple[int, int]], decode_ctx: Sequence[int]) -> float:
        """Seconds of one step computing prefill ``chunks`` (``(tokens, context before
        them)`` each) and one token for each decoding sequence (``decode_ctx``: their
        context lengths)."""
        tokens = sum(c for c, _ in chunks)
        pairs = sum(c * (ctx + (c + 1) / 2) for c, ctx in chunks)
        return (self.step_s + self.prefill_token_s * tokens + self.prefill_pair_s * pairs
                + self.decode_seq_s * len(decode_ctx) + self.decode_ctx_s * sum(decode_ctx))

    def prefill_alone_s(self, n: int, hit: int = 0) -> float:
        """Predicted TTFT of an ``n``-token prompt with ``hit`` tokens cached, alone on an
        idle engine: ``api_s`` + its chunked prefill steps."""
        h = min(max(hit, 0), n - 1)
        return self.api_s + sum(self.step_time([c], []) for c in chunk_plan(
            n - h, h, self.max_num_batched_tokens))

    def itl_s(self, batch: int, ctx: int = 0) -> float:
        """Predicted inter-token latency with ``batch`` sequences of ``ctx`` tokens."""
        return self.step_time([], [ctx] * batch)

    def load_s(self, tokens: int) -> float:
        """Seconds to load ``tokens`` tokens' KV from the store."""
        return max(tokens, 0) * self.kv_bytes_per_token / self.store_bandwidth_bps

    # ---- files ----
    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> EngineProfile:
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown profile fields {sorted(unknown)}")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ValueError(f"bad profile: {exc}") from exc

    def with_(self, **changes: Any) -> EngineProfile:
        return replace(self, **changes)

    def dilated(self, factor: float) -> EngineProfile:
        """The same engine ``factor`` times slower in every respect (steps, API, store
        loads): an emulation run at ``factor`` x wall time costs ``1/factor`` the CPU
        per emulated second; its measured times are divided by ``factor``."""
        if not factor > 0:
            raise ValueError("dilation factor must be > 0")
        if factor == 1:
            return self
        return replace(self, **{k: getattr(self, k) * factor for k in COEFFS},
                       store_bandwidth_bps=self.store_bandwidth_bps / factor,
                       shared_handoff_s=self.shared_handoff_s * factor,
                       name=f"{self.name}@x{factor:g}")


def chunk_plan(uncached: int, context: int, budget: int) -> list[tuple[int, int]]:
    """The ``(tokens, context)`` chunks a lone prefill of ``uncached`` tokens after
    ``context`` cached ones is cut into by a ``budget``-token step."""
    out = []
    done = 0
    while done < uncached:
        c = min(budget, uncached - done)
        out.append((c, context + done))
        done += c
    return out


def load(name_or_path: str | Path) -> EngineProfile:
    """A profile by name (``benchmarks/emulator/profiles/<name>.json``) or path."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILES / f"{p}.json"
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read profile {name_or_path}: {exc}") from exc
    return EngineProfile.from_json(raw)


# ----------------------------------------------------------------------------------- fit

@dataclass(frozen=True)
class PrefillPoint:
    """A measured lone TTFT: ``n`` prompt tokens, ``hit`` of them cached."""

    n: int
    hit: int
    ttft_s: float


@dataclass(frozen=True)
class DecodePoint:
    """A measured mean inter-token latency with ``batch`` sequences of ``ctx`` tokens."""

    batch: int
    ctx: int
    itl_s: float


def _features(p: PrefillPoint | DecodePoint, budget: int) -> list[float]:
    """The point's row over :data:`COEFFS`."""
    if isinstance(p, PrefillPoint):
        h = min(p.hit, p.n - 1)
        chunks = chunk_plan(p.n - h, h, budget)
        return [1.0, float(len(chunks)), float(sum(c for c, _ in chunks)),
                sum(c * (ctx + (c + 1) / 2) for c, ctx in chunks), 0.0, 0.0]
    return [0.0, 1.0, 0.0, 0.0, float(p.batch), float(p.batch * p.ctx)]


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0: the best fit over all subsets
    of columns whose unconstrained solution is non-negative (exact for a few columns)."""
    xw, yw = x * w[:, None], y * w
    best: tuple[float, np.ndarray] | None = None
    ncol = x.shape[1]
    for k in range(1, ncol + 1):
        for cols in itertools.combinations(range(ncol), k):
            coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(ncol)
            full[list(cols)] = coef
            sse = float(((xw @ full - yw) ** 2).sum())
            if best is None or sse < best[0] - 1e-18:
                best = (sse, full)
    assert best is not None
    return best[1]


def fit(prefill: Sequence[PrefillPoint], decode: Sequence[DecodePoint], *, name: str,
        source: str, **shape: Any) -> EngineProfile:
    """The profile whose step model best matches the points (relative errors weighted
    alike: each point weighs 1/measured). ``shape``: the non-timing fields."""
    if len(prefill) < 3 or len(decode) < 2:
        raise ValueError("need >= 3 prefill points and >= 2 decode points to fit")
    budget = int(shape.get("max_num_batched_tokens", 2048))
    pts: list[PrefillPoint | DecodePoint] = [*prefill, *decode]
    x = np.asarray([_features(p, budget) for p in pts], dtype=np.float64)
    y = np.asarray([p.ttft_s if isinstance(p, PrefillPoint) else p.itl_s for p in pts])
    coef = nonneg_lstsq(x, y, 1.0 / np.maximum(y, 1e-6))
    pred = x @ coef
    rel = np.abs(pred - y) / y
    timing: dict[str, Any] = dict(zip(COEFFS, map(float, coef)))
    prof = EngineProfile(name=name, source=source, **timing, **shape)
    report = {
        "prefill": [{**asdict(p), "predicted_s": float(q)} for p, q in
                    zip(prefill, pred[:len(prefill)])],
        "decode": [{**asdict(p), "predicted_s": float(q)} for p, q in
                   zip(decode, pred[len(prefill):])],
        "relative_error_median": float(np.median(rel)),
        "relative_error_max": float(rel.max())}
    return replace(prof, fit=report)
