"""Drive a :class:`Workload` against one or more OpenAI-compatible servers on asyncio.

Each session is one task: it waits for its arrival time, then sends its turns in order,
each after the previous answer plus the turn's think time, resending the whole history
with every turn. Requests go to the base URLs in global round-robin order (``routing=
"round-robin"``: a user's consecutive turns usually land on different servers) or stick to
one URL per session (``"session"``). A 429 is resent after its ``Retry-After`` up to
``retry_429`` times (the same server: the router behind it decides again). A failed or
rejected turn ends its session (a real client cannot continue a conversation without the
answer); the turns it would still have sent are counted as ``aborted_turns``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .client import Api, send
from .metrics import RequestRecord
from .tokens import TokenSource
from .workloads import Session, Workload

if TYPE_CHECKING:  # httpx comes with the router extra: imported where a request is made
    import httpx

FORMATS = ("auto", "text", "ids")
ROUTINGS = ("round-robin", "session")


def prompt_kind(src: TokenSource, endpoint: str, prompt_format: str) -> str:
    """How prompts go on the wire: ``"text"``, ``"ids"`` (completions) or ``"chat"``.

    ``"auto"`` is text where the tokenizer makes token-exact text, else token ids.
    Raises ``ValueError`` saying why when the tokenizer cannot serve the request.
    """
    if endpoint == "chat":
        if not src.text_exact:
            raise ValueError(
                "--endpoint chat needs a text tokenizer: chat messages are text that the "
                "server tokenises itself, and bench_serving writes token-exact text only "
                "from word tokens (a space followed by letters) that survive decode -> "
                f"encode. Here: {src.text_problem}. Use --endpoint completions, which "
                "sends token-id prompts (exact with any tokenizer).")
        return "chat"
    if prompt_format == "auto":
        return "text" if src.text_exact else "ids"
    if prompt_format == "text" and not src.text_exact:
        raise ValueError(f"--prompt-format text is not token-exact with this tokenizer "
                         f"({src.text_problem}); use --prompt-format ids or auto")
    return prompt_format


@dataclass(frozen=True)
class RunConfig:
    """Where and how to send: ``prompt_format`` applies to ``/v1/completions`` only."""

    base_urls: tuple[str, ...]
    api: Api
    prompt_format: str = "auto"
    routing: str = "round-robin"
    max_concurrency: int | None = None
    timeout_s: float = 600.0
    retry_429: int = 0  # resend a 429 after its Retry-After, up to this many times
    failover: bool = False  # a refused connection goes to the next base URL instead

    def __post_init__(self) -> None:
        if not self.base_urls:
            raise ValueError("need at least one --base-url")
        if self.prompt_format not in FORMATS or self.routing not in ROUTINGS:
            raise ValueError(f"prompt format must be in {FORMATS}, routing in {ROUTINGS}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.retry_429 < 0:
            raise ValueError("--retry-429 must be >= 0")


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    t_origin: float = 0.0  # time.perf_counter() at the timed run's start
    aborted_turns: int = 0
    warmup_errors: list[str] = field(default_factory=list)


class Conversation:
    """A session's history in the wire format; ``prompt`` adds a user turn."""

    def __init__(self, src: TokenSource, kind: str, system: tuple[int, ...]) -> None:
        self.src, self.kind = src, kind  # kind: "text" | "ids" | "chat"
        self.parts: list[str] = [src.text(system)] if system else []
        self.ids: list[int] = src.encode("") + list(system) if kind == "ids" else []
        self.messages: list[dict[str, str]] = (
            [{"role": "system", "content": src.text(system).lstrip()}] if system else [])

    def prompt(self, user: tuple[int, ...]) -> tuple[Any, int]:
        """(request prompt, its token count as the server will see it)."""
        if self.kind == "ids":
            ids = self.ids + list(user)
            return ids, len(ids)
        if self.kind == "chat":
            msgs = [*self.messages, {"role": "user", "content": self.src.text(user).lstrip()}]
            return msgs, len(self.src.chat_ids(msgs))
        text = "".join([*self.parts, self.src.text(user)])
        return text, len(self.src.encode(text))

    def add(self, user: tuple[int, ...], answer: str) -> None:
        """Append a finished turn: the user's tokens and the server's answer text."""
        if self.kind == "ids":
            self.ids += [*user, *self.src.encode(answer, special=False)]
        elif self.kind == "chat":
            self.messages += [{"role": "user", "content": self.src.text(user).lstrip()},
                              {"role": "assistant", "content": answer}]
        else:
            self.parts += [self.src.text(user), answer]


class Runner:
    def __init__(self, src: TokenSource, cfg: RunConfig, bar: Any = None) -> None:
        self.src, self.cfg, self.bar = src, cfg, bar
        self.kind = prompt_kind(src, cfg.api.endpoint, cfg.prompt_format)
        self._rr = itertools.cycle(range(len(cfg.base_urls)))
        self.records: list[RequestRecord] = []
        self.aborted = 0
        self.t_origin = 0.0

    def _url(self, s: Session) -> str:
        urls = self.cfg.base_urls
        if self.cfg.routing == "session":
            return urls[zlib.crc32(s.sid.encode()) % len(urls)]
        return urls[next(self._rr)]

    async def run(self, workload: Workload) -> RunResult:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(self.cfg.timeout_s, connect=30.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            warm_errors = await self._warmup(client, workload.warmup)
            first = {s.sid: await asyncio.to_thread(self._first, s) for s in workload.sessions}
            sem = asyncio.Semaphore(self.cfg.max_concurrency or 1 << 30)
            self.t_origin = time.perf_counter()
            await asyncio.gather(*(self._session(client, s, first[s.sid], sem)
                                   for s in workload.sessions))
            duration = time.perf_counter() - self.t_origin
        self.records.sort(key=lambda r: r.start_s)
        return RunResult(self.records, duration, self.t_origin, self.aborted, warm_errors)

    def _first(self, s: Session) -> tuple[Conversation, Any, int]:
        conv = Conversation(self.src, self.kind, s.system)
        return (conv, *conv.prompt(s.turns[0].user))

    async def _warmup(self, client: httpx.AsyncClient, sessions: list[Session]) -> list[str]:
        errors = []
        for s in sessions:
            conv = Conversation(self.src, self.kind, s.system)
            prompt, n = conv.prompt(s.turns[0].user)
            rec = RequestRecord(s.sid, 0, "", 0.0, n, s.turns[0].output_len)
            await send(client, self._url(s), self.cfg.api, prompt, rec, time.perf_counter())
            if not rec.success:
                errors.append(f"{s.sid}: {rec.error}")
        return errors

    async def _session(self, client: httpx.AsyncClient, s: Session,
                       first: tuple[Conversation, Any, int], sem: asyncio.Semaphore) -> None:
        conv, prompt, n = first
        await asyncio.sleep(max(0.0, self.t_origin + s.start_s - time.perf_counter()))
        for k, turn in enumerate(s.turns):
            if k:
                await asyncio.sleep(turn.gap_s)
                prompt, n = await asyncio.to_thread(conv.prompt, turn.user)
            rec = RequestRecord(s.sid, k, "", 0.0, n, turn.output_len)
            async with sem:
                answer = await send(client, self._url(s), self.cfg.api, prompt, rec,
                                    self.t_origin, self.cfg.retry_429,
                                    self.cfg.base_urls if self.cfg.failover else ())
            self.records.append(rec)
            self._tick(1)
            if not rec.success:
                self.aborted += len(s.turns) - k - 1
                self._tick(len(s.turns) - k - 1)
                return
            conv.add(turn.user, answer)

    def _tick(self, n: int) -> None:
        if self.bar is not None and n:
            with contextlib.suppress(Exception):
                self.bar.update(n)
