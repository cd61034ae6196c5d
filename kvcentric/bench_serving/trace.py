"""Mooncake-format trace replay: token prompts synthesised from ``hash_ids``.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``; hash id ``h`` at position ``i`` names the ``i``-th block of
:data:`TRACE_BLOCK` tokens together with everything before it. The prompt of a request is
the concatenation of one token block per hash id (cut to its input length), each block a
pure function of its id (:meth:`TokenSource.tagged_block`): equal ids give identical
blocks and different ids give different blocks, so the synthetic prompts share exactly the
prefixes the trace's requests shared.

``--sample-sessions F`` keeps whole conversations (:func:`session_key`), a seeded
fraction ``F`` of them, so a short replay keeps the trace's reuse across turns.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .tokens import TAG_DIGITS, TokenSource
from .workloads import Session, Turn, Workload, WorkloadSpec, poisson_starts

TRACE_BLOCK = 512


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, max_requests: int | None = None) -> list[TraceRecord]:
    """The first ``max_requests`` lines of a trace; ``ValueError`` names a bad line."""
    out: list[TraceRecord] = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if max_requests is not None and len(out) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rec = TraceRecord(float(d["timestamp"]), int(d["input_length"]),
                                  int(d["output_length"]), tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({e})") from None
            if rec.input_length < 1 or rec.output_length < 0 or not rec.hash_ids:
                raise ValueError(f"{path}:{lineno}: empty request")
            out.append(rec)
    return out


def block_tokens(scale: float) -> int:
    """Tokens per synthetic block after ``--scale-tokens``."""
    return max(TAG_DIGITS, round(TRACE_BLOCK * scale))


def scaled_lengths(rec: TraceRecord, scale: float) -> tuple[int, int]:
    """(input, output) tokens after scaling, the input kept inside its last hash block."""
    b = block_tokens(scale)
    n = len(rec.hash_ids)
    n_in = min(max(round(rec.input_length * scale), (n - 1) * b + 1), n * b)
    return n_in, max(1, round(rec.output_length * scale))


class Synthesizer:
    """Token prompts for hash-id lists; blocks are cached by id."""

    def __init__(self, src: TokenSource, block: int = TRACE_BLOCK, seed: int = 0) -> None:
        self.src, self.block, self.seed = src, block, seed
        self._cache: dict[int, tuple[int, ...]] = {}

    def block_of(self, hash_id: int) -> tuple[int, ...]:
        blk = self._cache.get(hash_id)
        if blk is None:
            blk = tuple(self.src.tagged_block(hash_id, self.block, self.seed))
            self._cache[hash_id] = blk
        return blk

    def prompt(self, hash_ids: Sequence[int], input_len: int) -> tuple[int, ...]:
        """``input_len`` tokens: the blocks of ``hash_ids`` in order, cut at the end."""
        if not (len(hash_ids) - 1) * self.block < input_len <= len(hash_ids) * self.block:
            raise ValueError(f"{len(hash_ids)} hash ids of {self.block} tokens cannot make "
                             f"a {input_len}-token prompt")
        out: list[int] = []
        for h in hash_ids:
            out.extend(self.block_of(h))
        return tuple(out[:input_len])


def session_key(rec: TraceRecord) -> int:
    """The conversation a request belongs to: its second hash id (ids are chained, so
    requests with equal second ids share their first two blocks: one conversation or
    document after the common system prompt), or its only one."""
    return rec.hash_ids[1] if len(rec.hash_ids) > 1 else rec.hash_ids[0]


def sampled(rec: TraceRecord, fraction: float | None, seed: int) -> bool:
    """Whether ``rec``'s conversation is in the seeded ``fraction`` of conversations."""
    if fraction is None:
        return True
    return zlib.crc32(f"{seed}/{session_key(rec)}".encode()) % 10_000 < fraction * 10_000


def _kept(records: list[TraceRecord], spec: WorkloadSpec) -> Iterator[tuple[TraceRecord, int, int]]:
    for rec in records:
        if not sampled(rec, spec.sample_sessions, spec.seed):
            continue
        n_in, n_out = scaled_lengths(rec, spec.scale_tokens)
        if spec.max_output_len is not None:
            n_out = min(n_out, spec.max_output_len)
        if spec.max_input_len is None or n_in <= spec.max_input_len:
            yield rec, n_in, n_out


def trace_workload(spec: WorkloadSpec, src: TokenSource) -> Workload:
    """One single-turn session per kept trace line (see :class:`WorkloadSpec`)."""
    assert spec.trace is not None
    records = read_trace(spec.trace, spec.max_requests)
    syn = Synthesizer(src, block_tokens(spec.scale_tokens), spec.seed)
    kept = list(_kept(records, spec))
    if spec.request_rate is not None:
        starts = poisson_starts(len(kept), spec.request_rate, random.Random(spec.seed))
    else:
        t0 = kept[0][0].timestamp_ms if kept else 0.0
        starts = [(rec.timestamp_ms - t0) / 1e3 * spec.time_scale for rec, _, _ in kept]
    sessions = [Session(f"r{i}", t, (Turn(syn.prompt(rec.hash_ids, n_in), n_out),))
                for i, ((rec, n_in, n_out), t) in enumerate(zip(kept, starts))]
    in_sample = sum(sampled(r, spec.sample_sessions, spec.seed) for r in records)
    return Workload("trace", sessions, info={
        "trace": str(spec.trace), "lines_read": len(records), "sampled": in_sample,
        "skipped_too_long": in_sample - len(kept), "block_tokens": syn.block,
        "distinct_blocks": len({h for rec, _, _ in kept for h in rec.hash_ids})})
