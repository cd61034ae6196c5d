"""Request streams for the simulated cluster (:mod:`.cluster`), each at a chosen offered rate.

Every builder returns :class:`~.cluster.Request` lists (arrival time, prompt tokens,
output tokens, the prompt's full 512-token blocks as chained ids: equal ids, equal
content) sorted by arrival, for a given offered rate in requests per second and seed:

- :func:`trace`: a Mooncake FAST'25 trace (``hash_ids`` are already such blocks), its
  arrival times scaled so its mean rate is the offered one (the same requests in the same
  pattern at every rate, as the paper replays its traces faster and slower);
- :func:`hot_prefix`: a few long prefixes, Zipf-popular, each request a prefix and its own
  question, Poisson arrivals;
- :func:`agentic`: coding-agent sessions (a long system prompt every session shares, a
  long first turn, a little more context every turn, tens of turns, think time between
  turns), sessions arriving as a Poisson process. Open loop: a turn arrives the think
  time plus the previous answer's decode time (at ``tbt_s``) after the previous turn,
  whether or not that answer came, so the offered rate does not bend to the arm's speed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim.cluster import BLOCK, Request


def read_trace(path: Path, limit: int | None = None) -> list[Request]:
    """The trace's first ``limit`` requests at their own times (seconds from the first);
    ``ValueError`` when it holds none."""
    reqs: list[Request] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(reqs) >= limit:
                break
            rec = json.loads(line)
            n = int(rec["input_length"])
            reqs.append(Request(rec["timestamp"] / 1000.0, n, int(rec["output_length"]),
                                tuple(rec["hash_ids"][:n // BLOCK])))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    t0 = reqs[0].t
    return [Request(r.t - t0, r.n, r.out, r.blocks) for r in reqs]


def trace(reqs: list[Request], rate: float) -> list[Request]:
    """``reqs`` with arrival times scaled so ``len(reqs) - 1`` gaps span
    ``(len(reqs) - 1) / rate`` seconds; ``ValueError`` for a rate <= 0 or a trace whose
    requests all arrive at once."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    span = reqs[-1].t - reqs[0].t
    if len(reqs) < 2 or span <= 0:
        raise ValueError("a trace needs two requests at different times to be rescaled")
    k = (len(reqs) - 1) / rate / span
    return [Request((r.t - reqs[0].t) * k, r.n, r.out, r.blocks) for r in reqs]


class _Ids:
    """Fresh block ids (content nobody else has)."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


@dataclass(frozen=True)
class HotPrefix:
    """``groups`` prefixes of ``prefix_tokens``, popularity ``1 / (g + 1) ** skew``; each
    request adds ``question_tokens`` of its own and asks for ``output_tokens``."""

    groups: int = 32
    prefix_tokens: int = 8192
    question_tokens: int = 512
    output_tokens: int = 128
    skew: float = 1.0

    def build(self, n: int, rate: float, seed: int) -> list[Request]:
        rnd = random.Random(f"hot-prefix/{seed}")
        ids = _Ids(1 << 40)
        prefixes = [ids.take(self.prefix_tokens // BLOCK) for _ in range(self.groups)]
        weights = [1 / (g + 1) ** self.skew for g in range(self.groups)]
        t, out = 0.0, []
        size = self.prefix_tokens + self.question_tokens
        for _ in range(n):
            p = rnd.choices(prefixes, weights)[0]
            blocks = p + ids.take(size // BLOCK - len(p))
            out.append(Request(t, size, self.output_tokens, blocks))
            t += rnd.expovariate(rate)
        return out


@dataclass(frozen=True)
class Agentic:
    """Coding-agent sessions: ``system_tokens`` shared by all, ``first_tokens`` of a
    session's own with its first turn, ``turn_tokens`` more each later turn (plus the
    previous answer), ``min_turns``..``max_turns`` turns (uniform), think time between
    turns exponential with mean ``think_s``."""

    system_tokens: int = 20480
    first_tokens: int = 10240
    turn_tokens: int = 2048
    output_tokens: int = 256
    min_turns: int = 2
    max_turns: int = 30
    think_s: float = 5.0
    tbt_s: float = 0.02

    @property
    def mean_turns(self) -> float:
        return (self.min_turns + self.max_turns) / 2

    def build(self, n: int, rate: float, seed: int) -> list[Request]:
        """At least ``n`` requests (whole sessions); sessions arrive at ``rate /
        mean_turns`` per second so requests are offered at about ``rate``."""
        rnd = random.Random(f"agentic/{seed}")
        ids = _Ids(1 << 41)
        system = ids.take(self.system_tokens // BLOCK)
        out: list[Request] = []
        start = 0.0
        while len(out) < n:
            ctx = self.system_tokens + self.first_tokens
            tokens = list(system) + list(ids.take((ctx - self.system_tokens) // BLOCK))
            t = start
            for k in range(rnd.randint(self.min_turns, self.max_turns)):
                if k:
                    ctx += self.output_tokens + self.turn_tokens
                    tokens += ids.take(ctx // BLOCK - len(tokens))
                    t += self.output_tokens * self.tbt_s + rnd.expovariate(1 / self.think_s)
                out.append(Request(t, ctx, self.output_tokens, tuple(tokens)))
            start += rnd.expovariate(rate / self.mean_turns)
        out.sort(key=lambda r: r.t)
        return out
