"""One emulated engine: vLLM's continuous-batching scheduler, timed by a profile.

:class:`EngineCore` is the scheduler as a state machine with no clock of its own: each
:meth:`EngineCore.plan` takes every decoding sequence (one token each) and fills the rest
of the token budget with prefill chunks, first of running prefills, then of waiting
requests in arrival order (FCFS; a request is admitted when ``max_num_seqs`` and its
prompt's pages allow, else it and everything behind it wait). Admitting a request looks
up its prompt in the engine's page cache (:mod:`.pages`) and, with a connector, in the
store (:mod:`.connector`); a store hit beyond the engine's own pages adds its load time
to the step, or, with :attr:`EngineCore.async_loads` (the connector's asynchronous loads,
as a P/D decode instance runs them), is loaded beside the steps: the request holds its
pages and computes from the first step planned after its load is done, the engine's loads
one after another at the profile's bandwidth, the running batch's steps never waiting
for them (a GPU's copy engines move them while its SMs compute).
:meth:`EngineCore.finish` applies a step: computed pages are cached (KV
events), a request whose last prompt token was computed emits its first token (and its
blocks go to the store), decoding requests emit one token each, finished ones free
their pages. The step lasts :meth:`EngineProfile.step_time` on the engine's processor.

How steps of engines sharing a processor are timed is :mod:`.processors`' business.

:func:`predict_alone` runs one core on a virtual clock (tests, the profile's checks).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .connector import StoreHits
from .pages import PageCache, SeqPages
from .profile import EngineProfile


@dataclass(eq=False)
class Request:
    """One request inside an engine; times from the engine's clock (seconds)."""

    rid: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None
    arrival: float = 0.0
    on_token: Callable[[int, bool], None] | None = None  # (token id, last?)
    next_token: Callable[[int], int] = lambda i: 100 + i  # the i-th output token's id
    # prompt tokens whose KV a P/D transfer brought (an SGLang decode server's request):
    # loaded like a store hit, at the profile's load bandwidth
    transferred: int = 0
    seq: SeqPages = field(init=False)
    computed: int = 0  # prompt tokens whose KV the engine has (hits included)
    local_hit: int = 0
    external_hit: int = 0
    load_s: float = 0.0
    ready_at: float = 0.0  # an asynchronous load's end (engine clock)
    output: int = 0
    t_admit: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    t_last: float | None = None  # when its last token was emitted
    gaps: list[float] = field(default_factory=list)  # its inter-token gaps, engine side
    aborted: bool = False

    def __post_init__(self) -> None:
        self.seq = SeqPages(list(self.prompt), self.salt)

    @property
    def n(self) -> int:
        return len(self.prompt)

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.n

    @property
    def cached_tokens(self) -> int:
        return self.local_hit + self.external_hit


@dataclass(frozen=True)
class Finished:
    """A finished request as the per-request reports need it. An engine keeps thousands
    (a capacity sweep's every run): kept as :class:`Request`, each held its prompt's and
    its sequence's token lists, and a long sweep's emulator ran out of memory."""

    rid: str
    n: int
    max_tokens: int
    arrival: float
    t_admit: float | None
    t_first: float | None
    t_done: float | None
    local_hit: int
    external_hit: int
    load_s: float
    gaps: tuple[float, ...]

    @classmethod
    def of(cls, r: Request) -> Finished:
        return cls(r.rid, r.n, r.max_tokens, r.arrival, r.t_admit, r.t_first, r.t_done,
                   r.local_hit, r.external_hit, r.load_s, tuple(r.gaps))


@dataclass
class Step:
    chunks: list[tuple[Request, int]]
    decodes: list[Request]
    admitted: list[Request]
    work_s: float


@dataclass
class Counters:
    """vLLM's counters, as its ``/metrics`` names them (without the prefix)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    busy_s: float = 0.0


class EngineCore:
    def __init__(self, profile: EngineProfile, pages: int,
                 connector: StoreHits | None = None) -> None:
        self.p = profile
        self.cache = PageCache(pages, profile.page_size)
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.async_loads = False
        self.loading: list[Request] = []  # admitted, their KV still arriving (async loads)
        self._loads_free = 0.0  # when this engine's load of the last such request ends
        self.counters = Counters()
        self.finished: deque[Finished] = deque(maxlen=20000)  # for per-request reports

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """The client went away: drop ``req`` (a step under way skips it)."""
        if req.aborted or req.t_done is not None:
            return
        req.aborted = True
        self.counters.aborted += 1
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running or req in self.loading:
            (self.running if req in self.running else self.loading).remove(req)
            self.cache.release(req.seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.loading

    def next_load_s(self, now: float) -> float | None:
        """Seconds from ``now`` until an asynchronous load ends (None: none under way):
        an engine with nothing else to do plans its next step then."""
        return max(0.0, min(r.ready_at for r in self.loading) - now) if self.loading else None

    def plan(self, now: float) -> Step | None:
        """The next step's batch (admissions applied), or None when there is no work."""
        p = self.p
        if self.loading and any(r.ready_at <= now for r in self.loading):
            self.running += [r for r in self.loading if r.ready_at <= now]
            self.loading = [r for r in self.loading if r.ready_at > now]
        decodes = [r for r in self.running if r.prefilled]
        budget = p.max_num_batched_tokens - len(decodes)
        chunks: list[tuple[Request, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if not r.prefilled:
                c = min(r.n - r.computed, budget)
                chunks.append((r, c))
                budget -= c
        admitted = []
        load = 0.0
        while self.waiting and budget > 0 and len(self.running) < p.max_num_seqs:
            r = self.waiting[0]
            hit_pages = self.cache.match(r.seq)
            local = hit_pages * p.page_size
            stored = self.connector.lookup(r.prompt, r.salt) if self.connector else 0
            stored = max(stored, r.transferred)
            if not self.cache.admit(r.seq, hit_pages, r.n):
                break
            self.waiting.popleft()
            admitted.append(r)
            r.t_admit = now
            r.local_hit = local
            r.external_hit = max(0, stored - local)
            r.computed = local + r.external_hit
            r.load_s = p.load_s(r.external_hit)
            self._count_admission(r)
            if self.async_loads and r.load_s > 0:
                r.ready_at = self._loads_free = max(now, self._loads_free) + r.load_s
                self.loading.append(r)
                continue
            self.running.append(r)
            load += r.load_s
            c = min(r.n - r.computed, budget)
            chunks.append((r, c))
            budget -= c
        if not chunks and not decodes:
            return None
        work = p.step_time([(c, r.computed) for r, c in chunks],
                           [r.n + r.output for r in decodes]) + load
        return Step(chunks, decodes, admitted, work)

    def _count_admission(self, r: Request) -> None:
        k = self.counters
        k.requests += 1
        k.prompt_tokens += r.n
        k.prefix_cache_queries += r.n
        k.prefix_cache_hits += r.local_hit
        if self.connector is not None:
            k.external_prefix_cache_queries += r.n - r.local_hit
            k.external_prefix_cache_hits += r.external_hit

    def finish(self, step: Step, now: float) -> list[Request]:
        """Apply ``step`` (done at ``now``); returns the requests that finished."""
        cache = self.cache
        self.counters.steps += 1
        self.counters.busy_s += step.work_s
        done: list[Request] = []
        for r, c in step.chunks:
            if r.aborted:
                continue
            r.computed += c
            cache.commit(r.seq, r.computed)
            if r.prefilled:
                r.t_first = now
                if self.connector is not None:
                    self.connector.save(r.prompt, r.salt, with_tail=True)
                self._emit(r, done)
        for r in step.decodes:
            if not r.aborted:
                self._emit(r, done)
        for r in done:
            r.t_done = now
            self.counters.finished += 1
            self.running.remove(r)
            if self.connector is not None and r.output > 1:
                self.connector.save(r.seq.tokens[:r.n + r.output - 1], r.salt, with_tail=False)
            cache.release(r.seq)
            self.finished.append(Finished.of(r))
        return done

    def _emit(self, r: Request, done: list[Request]) -> None:
        """``r`` produced its next token (its KV is computed at the next step)."""
        tok = r.next_token(r.output)
        r.output += 1
        self.counters.generation_tokens += 1
        last = r.output >= r.max_tokens
        if not last:
            r.seq.tokens.append(tok)
            self.cache.grow(r.seq, r.n + r.output)
            self.cache.commit(r.seq, r.n + r.output - 1)
        if r.on_token is not None:
            r.on_token(tok, last)
        if last:
            done.append(r)


def predict_alone(profile: EngineProfile, reqs: Sequence[tuple[float, int, int, int]],
                  pages: int = 1 << 20) -> dict[str, Any]:
    """Run one engine core on a virtual clock: ``reqs`` = (arrival s, prompt tokens,
    unused, max tokens) with prompts that share nothing; returns each one's ``ttft_s``
    (api_s included) and ``e2e_s`` in the given order."""
    core = EngineCore(profile, pages)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][0])
    objs = [Request(f"r{i}", [1_000_000 * (i + 1) + k for k in range(n)], max(1, m),
                    arrival=t) for i, (t, n, _, m) in enumerate(reqs)]
    now, k = 0.0, 0
    while k < len(order) or not core.idle:
        while k < len(order) and objs[order[k]].arrival + profile.api_s <= now + 1e-12:
            core.add(objs[order[k]])
            k += 1
        step = core.plan(now)
        if step is None:
            now = objs[order[k]].arrival + profile.api_s
            continue
        now += step.work_s
        core.finish(step, now)
    nan = math.nan
    return {"ttft_s": [(r.t_first or nan) - r.arrival for r in objs],
            "e2e_s": [(r.t_done or nan) - r.arrival for r in objs]}
