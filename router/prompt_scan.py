"""Tokenise a text prompt only as far as routing needs: to the first block held nowhere.

Why: the router tokenises a prompt to hash its blocks and find where they are cached, and
tokenising is most of its CPU on long prompts (the conversation trace's prompts average
63k characters). Past the first block that no engine and not the store holds, nothing of
the prompt can be loaded anywhere: its hashes would change no decision, and the engine
tokenises the request itself. So the prompt is tokenised in pieces that grow from
``first_chars`` characters to ``piece_chars`` (each through the prompt token cache, which
joins pieces where a whole tokenisation puts the same ids:
:meth:`PromptTokenizer.known_prefix
<kvcentric.router.tokenize.PromptTokenizer.known_prefix>`), and after each piece the
caller says whether every full block so far is held somewhere; the first that is not ends
the scan. A prompt held to its end is tokenised whole, exactly as without the scan.

What a stopped scan gives instead of the exact count: the tokens so far plus the
characters left at the tokens-per-character of what was tokenised (the cost model's
prefill time of the uncached rest, the same estimate for every instance). The router's
own refusal of a prompt too long for the context needs the exact count. A prompt whose
:meth:`token_bound <kvcentric.router.tokenize.PromptTokenizer.token_bound>` (one token
per byte at most) is within the limit needs none; any other is scanned with
``exact_above`` at half the limit, so only an estimate under half the limit spares it the
whole tokenisation and the exact check (``openai_routes``). A prompt whose text
tokenises at more than twice the rate of its first piece can then reach the engine over
the context, and the engine refuses it with its own 400. The blocks a router marks resident on
the instance it chose are those it hashed, then the rest of a stopped scan's prompt,
hashed after the dispatch (``rest`` of :meth:`Proxy.handle
<kvcentric.router.api.proxy.Proxy.handle>`, announced to the other router replicas);
the engine's KV events confirm them.

Runs on the router's event loop; tokenising runs on worker threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from kvcentric.router.tokenize import Plan, PromptTokenizer

# characters tokenised by a scan's first piece, then twice as many each piece up to
# PIECE_CHARS: most scans stop at once (the text past what the prompt token cache knows is
# new, so its first block is held nowhere) and pay for a small piece only, while a long
# held prefix the cache does not know takes a few steps (each one store lookup). The first
# piece spans several of the cache's chunks (PrefixTokens' anchor_chars), so it ends past
# a pre-token boundary the cache can vouch for
FIRST_PIECE_CHARS = 2048
PIECE_CHARS = 16384


@dataclass(frozen=True)
class Scanned:
    """``tokens``: the prompt's first ``len(tokens)`` token ids (all of them when
    ``complete``, ``[n]`` uint32); ``n_tokens``: its length, exact when ``complete``, else
    estimated."""

    tokens: np.ndarray
    n_tokens: int
    complete: bool


def left_from(plan: Plan) -> int:
    """Where ``plan``'s text starts to need tokenising (past its known prefix)."""
    return plan.reuse.start if plan.reuse is not None else 0


def worth_scanning(plan: Plan, first_chars: int = FIRST_PIECE_CHARS) -> bool:
    """Whether more than a first piece of ``plan``'s text is left to tokenise: else it is
    tokenised whole, at the cost of that piece, and no lookup is spent on it."""
    return len(plan.text) - left_from(plan) > first_chars


async def scan(tok: PromptTokenizer, plan: Plan,
               held: Callable[[np.ndarray], Awaitable[bool]],
               piece_chars: int = PIECE_CHARS, exact_above: int | None = None,
               first_chars: int = FIRST_PIECE_CHARS) -> Scanned:
    """Tokenise ``plan``'s text piece by piece (the first of ``first_chars`` characters,
    each next one twice the last, up to ``piece_chars``) while ``held(tokens)`` says every
    full block of the tokens so far is cached somewhere; whole (as
    :meth:`PromptTokenizer.run`) when the tokenizer cannot join pieces
    (:attr:`PromptTokenizer.scans`), the text is held to its end, or the estimate of a
    stopped scan is over ``exact_above`` tokens (the caller then needs the exact count).
    ``plan.verify``: a stopped scan's tokens are checked against a whole tokenisation (which
    replaces them on a mismatch)."""
    text, special = plan.text, plan.add_special_tokens
    step = min(first_chars, piece_chars)
    cut = left_from(plan) + step  # what the prompt token cache knows costs nothing
    while tok.scans and cut < len(text):
        ids, chars = await asyncio.to_thread(tok.known_prefix, text, special, cut, plan.reuse)
        if not await held(ids):
            rest = len(text) - chars
            per_char = len(ids) / chars if chars else 0.25
            n = len(ids) + max(1, round(rest * per_char))
            if exact_above is not None and n > exact_above:
                break
            if plan.verify:
                checked = await asyncio.to_thread(tok.check_prefix, text, special, ids)
                if checked is not None:
                    return Scanned(checked, len(checked), True)
            return Scanned(ids, n, False)
        step = min(2 * step, piece_chars)
        cut += step
    ids = await whole(tok, tok.replan(plan))  # the pieces scanned are not tokenised again
    return Scanned(ids, len(ids), True)


async def whole(tok: PromptTokenizer, plan: Plan) -> np.ndarray:
    """``plan``'s text tokenised whole (:meth:`PromptTokenizer.run`): on a worker thread
    only for much to tokenise (the Rust tokenizer releases the GIL and the loop serves
    others meanwhile; a hand-off costs more than a little)."""
    run = tok.run
    return run(plan) if plan.inline else await asyncio.to_thread(run, plan)
