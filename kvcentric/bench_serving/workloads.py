"""Workloads as sessions of turns, built from word tokens (see :mod:`.tokens`).

Every workload is a list of :class:`Session`: a user who arrives at ``start_s`` and sends
its turns one after another, each turn resending the system prompt, all earlier user
turns and the answers the server gave (the runner appends the answers). Single-request
workloads are one-turn sessions. ``warmup`` sessions are sent one by one before the timed
run and are not measured (the hit-ratio workload uses them to serve its prefixes).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from .tokens import TokenSource

WORKLOADS = ("multi-turn", "shared-prefix", "hit-ratio", "trace")


@dataclass(frozen=True)
class Turn:
    """One request of a session: new user tokens, answer length, think time before it."""

    user: tuple[int, ...]
    output_len: int
    gap_s: float = 0.0


@dataclass(frozen=True)
class Session:
    sid: str
    start_s: float
    turns: tuple[Turn, ...]
    system: tuple[int, ...] = ()


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: list[Session]
    warmup: list[Session] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class WorkloadSpec:
    """All workload knobs (CLI flags of the same names); ``ValueError`` on bad values.

    ``request_rate``/``user_rate`` None or inf: everything arrives at once (trace: None
    replays the trace's own timestamps times ``time_scale``).
    """

    workload: str = "multi-turn"
    seed: int = 0
    output_len: int = 32
    # multi-turn
    num_users: int = 8
    turns_mean: float = 3.0
    turns_std: float = 0.0
    shared_system_prompt_len: int = 256
    user_context_len: int = 512
    turn_input_len: int = 64
    user_rate: float | None = None
    turn_gap: float = 0.0
    # shared-prefix (system prompt: shared_system_prompt_len, question: turn_input_len)
    num_groups: int = 4
    prompts_per_group: int = 4
    group_skew: float = 0.0  # Zipf exponent of the groups' popularity (0: all alike)
    # hit-ratio
    input_len: int = 1024
    hit_ratio: float = 0.5
    num_prompts: int = 8
    request_rate: float | None = None
    # trace
    trace: str | None = None
    time_scale: float = 1.0
    max_requests: int | None = None
    scale_tokens: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None
    sample_sessions: float | None = None

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; known: {WORKLOADS}")
        for name in ("output_len", "num_users", "num_groups", "prompts_per_group",
                     "num_prompts", "input_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("shared_system_prompt_len", "user_context_len", "turn_input_len",
                     "turn_gap", "turns_std"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.turns_mean < 1:
            raise ValueError("--turns-mean must be >= 1")
        if not self.group_skew >= 0:
            raise ValueError("--group-skew must be >= 0")
        if not 0.0 <= self.hit_ratio <= 1.0:
            raise ValueError("--hit-ratio must be in [0, 1]")
        for name in ("user_rate", "request_rate"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if not (self.time_scale > 0 and 0 < self.scale_tokens <= 1):
            raise ValueError("--time-scale must be > 0 and --scale-tokens in (0, 1]")
        if self.max_output_len is not None and self.max_output_len < 1:
            raise ValueError("--max-output-len must be >= 1")
        if self.sample_sessions is not None and not 0 < self.sample_sessions <= 1:
            raise ValueError("--sample-sessions must be in (0, 1]")
        if self.workload == "trace" and not self.trace:
            raise ValueError("workload 'trace' needs --trace FILE.jsonl")
        if self.workload == "multi-turn" and self.user_context_len + self.turn_input_len < 1:
            raise ValueError("multi-turn turns need --user-context-len or --turn-input-len")


def poisson_starts(n: int, rate: float | None, rnd: random.Random) -> list[float]:
    """Arrival offsets (s) of ``n`` events of a Poisson process; all 0 when rate is None/inf."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rnd.expovariate(rate)
    return out


def build(spec: WorkloadSpec, src: TokenSource) -> Workload:
    """The workload ``spec.workload`` (trace files are read here)."""
    if spec.workload == "multi-turn":
        return multi_turn(spec, src)
    if spec.workload == "shared-prefix":
        return shared_prefix(spec, src)
    if spec.workload == "hit-ratio":
        return hit_ratio(spec, src)
    from .trace import trace_workload

    return trace_workload(spec, src)


def _num_turns(spec: WorkloadSpec, rnd: random.Random) -> int:
    return max(1, round(rnd.gauss(spec.turns_mean, spec.turns_std)))


def multi_turn(spec: WorkloadSpec, src: TokenSource) -> Workload:
    """Users share one system prompt; each has a private context sent with its first turn."""
    rnd = random.Random(f"multi-turn/{spec.seed}")
    system = tuple(src.random_ids(rnd, spec.shared_system_prompt_len))
    starts = poisson_starts(spec.num_users, spec.user_rate, rnd)
    sessions = []
    for u, start in enumerate(starts):
        turns = []
        for k in range(_num_turns(spec, rnd)):
            ctx = spec.user_context_len if k == 0 else 0
            user = tuple(src.random_ids(rnd, ctx + spec.turn_input_len))
            turns.append(Turn(user, spec.output_len, spec.turn_gap if k else 0.0))
        sessions.append(Session(f"user{u}", start, tuple(turns), system))
    return Workload("multi-turn", sessions, info={"system_prompt_tokens": len(system)})


def shared_prefix(spec: WorkloadSpec, src: TokenSource) -> Workload:
    """G groups x P prompts; a group's prompts share its system prompt (sglang's gsp).
    With ``group_skew`` s > 0 the G x P prompts are spread over the groups in proportion
    to ``1 / (g + 1) ** s`` (Zipf: a few hot prefixes, a tail of cold ones)."""
    rnd = random.Random(f"shared-prefix/{spec.seed}")
    total = spec.num_groups * spec.prompts_per_group
    counts = [spec.prompts_per_group] * spec.num_groups
    if spec.group_skew > 0:
        w = [1 / (g + 1) ** spec.group_skew for g in range(spec.num_groups)]
        counts = [max(1, round(total * x / sum(w))) for x in w]
    reqs = []
    for g in range(spec.num_groups):
        system = tuple(src.random_ids(rnd, spec.shared_system_prompt_len))
        for p in range(counts[g]):
            question = tuple(src.random_ids(rnd, max(1, spec.turn_input_len)))
            reqs.append((f"g{g}p{p}", system, question))
    rnd.shuffle(reqs)  # interleave groups, as a real mix would
    starts = poisson_starts(len(reqs), spec.request_rate, rnd)
    sessions = [Session(sid, t, (Turn(q, spec.output_len),), system)
                for (sid, system, q), t in zip(reqs, starts)]
    return Workload("shared-prefix", sessions)


def hit_ratio(spec: WorkloadSpec, src: TokenSource) -> Workload:
    """Prompts of ``input_len`` tokens whose first ``hit_ratio`` share was served before."""
    rnd = random.Random(f"hit-ratio/{spec.seed}")
    n_hit = round(spec.hit_ratio * spec.input_len)
    warmup, sessions = [], []
    starts = poisson_starts(spec.num_prompts, spec.request_rate, rnd)
    for i, t in enumerate(starts):
        prefix = tuple(src.random_ids(rnd, n_hit))
        rest = tuple(src.random_ids(rnd, spec.input_len - n_hit))
        if prefix:
            warmup.append(Session(f"warm{i}", 0.0, (Turn(prefix, 1),)))
        sessions.append(Session(f"p{i}", t, (Turn(prefix + rest, spec.output_len),)))
    return Workload("hit-ratio", sessions, warmup,
                    info={"prefix_tokens": n_hit, "input_len": spec.input_len})

