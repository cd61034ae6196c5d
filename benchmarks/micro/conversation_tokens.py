"""What does the router spend tokenising a coding agent's growing conversations?

    python -m benchmarks.micro.conversation_tokens [--quick] [--out FILE.json]

Sessions shaped like the capacity benchmark's coding agent (``slo_fleet.AGENT``: a shared
system prompt of about 20k tokens, a first turn of about 10k, about 2k more a turn, short
answers) are rendered with the bench model's chat template, turn by turn, and each prompt
goes through what the router does with it (:mod:`kvcentric.router.prompt_scan`): the plan
on the event loop (the prompt token cache's lookup), the scan on worker threads up to the
first block held nowhere (here: past the previous turn's prompt), then the rest of the
prompt tokenised after the dispatch. Per request, medians over the requests of a round:

- ``plan_ms``: the plan alone (the event loop's share; wall time of that call);
- ``router_cpu_ms``: plan, scan and rest, CPU time of the process (threads included);
- ``whole_cpu_ms``: the baseline in the same run, the same prompts tokenised whole.

Rounds alternate (cached, whole, whole, cached, ...), each a fresh set of sessions, and the
summary gives each measure's median over the rounds with its range. The tokens the cache
reused are checked against a whole tokenisation on a sample of prompts (the router's own
check); a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from benchmarks.serving.slo_fleet import AGENT
from kvcentric.router.config import CacheConfig
from kvcentric.router.prompt_scan import scan, whole
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.testing.models import build_model

ANSWER_WORDS = 48  # an answer of about the capacity benchmark's 64 tokens
SESSIONS = 8  # conversations at once, their turns interleaved as they arrive


class Sessions:
    """``n`` conversations of ``turns`` turns with one shared system prompt; a word is
    about 1.4 tokens of the bench tokenizer, so word counts are token counts / 1.4."""

    def __init__(self, seed: int, n: int, turns: int, scale: float) -> None:
        self.rnd = random.Random(seed)
        self.vocab = ["".join(self.rnd.choice("abcdefghijklmnopqrstuvwxyz")
                              for _ in range(self.rnd.randrange(2, 9))) for _ in range(4000)]
        system = self.words(AGENT["system"] * scale)
        self.chats = [[{"role": "system", "content": system},
                       {"role": "user", "content": self.words(AGENT["first"] * scale)}]
                      for _ in range(n)]
        self.turns = turns
        self.scale = scale

    def words(self, tokens: float) -> str:
        return " ".join(self.rnd.choice(self.vocab) for _ in range(round(tokens / 1.4)))

    def bodies(self) -> list[dict[str, Any]]:
        """Every turn's request body, turn by turn across the sessions (as they arrive)."""
        out = []
        for _ in range(self.turns):
            for chat in self.chats:
                out.append({"messages": [dict(m) for m in chat]})
                chat.append({"role": "assistant", "content": self.words(ANSWER_WORDS * 1.4)})
                chat.append({"role": "user", "content": self.words(AGENT["turn"] * self.scale)})
        return out


def cached_round(tok: PromptTokenizer, texts: list[str], shared: int) -> dict[str, float]:
    """Each text as the router tokenises it, the first ``shared`` tokens (the system
    prompt) and each session's last prompt held somewhere; per-request medians."""
    plans, cpus = [], []
    held_upto: dict[str, int] = {}  # session -> tokens of its last prompt

    async def one(text: str, session: str) -> None:
        t0 = time.perf_counter()
        plan = tok.plan(text, False)
        plans.append(time.perf_counter() - t0)
        upto = held_upto.get(session, shared)

        async def held(ids: np.ndarray) -> bool:
            return len(ids) <= upto

        scanned = await scan(tok, plan, held)
        n = scanned.n_tokens
        if not scanned.complete:
            n = len(await whole(tok, tok.replan(plan)))
        held_upto[session] = n

    async def run() -> None:
        for i, text in enumerate(texts):
            c0 = time.process_time()
            await one(text, str(i % SESSIONS))
            cpus.append(time.process_time() - c0)

    asyncio.run(run())
    return {"plan_ms": statistics.median(plans) * 1e3,
            "router_cpu_ms": statistics.median(cpus) * 1e3}


def whole_round(tok: PromptTokenizer, texts: list[str]) -> dict[str, float]:
    cpus = []
    for text in texts:
        c0 = time.process_time()
        tok.encode(text, False)
        cpus.append(time.process_time() - c0)
    return {"whole_cpu_ms": statistics.median(cpus) * 1e3}



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 turns, 2 rounds a side")
    ap.add_argument("--rounds", type=int, default=None, help="rounds a side (default 3)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: results/conversation_tokens[_quick].json")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    turns = 6 if args.quick else 12
    out = args.out or RESULTS / f"conversation_tokens{'_quick' if args.quick else ''}.json"
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    plain = PromptTokenizer(model)
    reps: dict[str, list[float]] = {"plan_ms": [], "router_cpu_ms": [], "whole_cpu_ms": []}
    chars = 0
    for r in range(2 * rounds):
        sessions = Sessions(r, SESSIONS, turns, 1.0)
        texts = [plain.chat_text(b) for b in sessions.bodies()]
        chars = max(chars, max(len(t) for t in texts))
        if (r + r // 2) % 2 == 0:  # cached, whole, whole, cached, ...
            tok = PromptTokenizer(model, cache_chars=CacheConfig().prompt_text_chars)
            shared = len(plain.encode(sessions.chats[0][0]["content"], False))
            got = cached_round(tok, texts, shared)
            for t in texts[-SESSIONS:]:  # the longest: each a whole tokenisation's ids?
                want = plain.encode(t, False)
                if not np.array_equal(tok.encode(t, False), want):
                    raise RuntimeError("the prompt token cache gave other ids")
        else:
            got = whole_round(plain, texts)
        for k, v in got.items():
            reps[k].append(v)
        print(f"round {r}: {json.dumps({k: round(v, 3) for k, v in got.items()})}")
    summary: dict[str, Any] = {}
    for k, vs in reps.items():
        summary[k] = statistics.median(vs)
        summary[f"{k}_range"] = [min(vs), max(vs)]
    summary["whole_over_router_cpu"] = summary["whole_cpu_ms"] / summary["router_cpu_ms"]
    doc = {"summary": summary, "reps": reps, "sessions": SESSIONS, "turns": turns,
           "rounds_per_side": rounds, "longest_prompt_chars": chars, "agent": AGENT,
           "quick": args.quick}
    rw.write(out, doc, table=json.dumps(summary, indent=2),
             command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
