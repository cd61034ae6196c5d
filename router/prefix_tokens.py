"""Token ids of prompt texts seen before, kept by text prefix, so a prompt that starts
with a known long prefix is tokenised only from near its end.

Why: the router tokenises every prompt to hash its blocks, and tokenising costs router
CPU in proportion to the prompt's length (most of it the pre-tokenizer's regex over the
whole text); prompts that share a long prefix (system
prompts, documents, a conversation's history) would pay it again each time.

How it stays exact: a byte-level BPE tokenizer splits text into pre-tokens by a regex and
merges within each pre-token only, so the ids up to a pre-token boundary ``c`` depend on
the text up to ``c`` plus a few characters of look-ahead. An entry is a text chunk ending
at such a boundary (an *anchor*: the first token starting a pre-token at least
``anchor_chars`` characters after the previous anchor) with the ids of the chunk, chained
from the text's start like the blocks of a radix tree. A new text walks the chain chunk
by chunk; it reuses the ids up to the anchor *before* the last chunk it matched (so at
least one chunk of identical text follows the reused anchor: the look-ahead), then
tokenises the rest, without special tokens, and adds anchors for it. Whether this gives
the tokenizer's own ids is not assumed: :class:`PromptTokenizer
<kvcentric.router.tokenize.PromptTokenizer>` checks it on probe texts before using the
cache and whole-tokenises a sample of cached results afterwards
(:meth:`PrefixTokens.should_verify`); any mismatch turns the cache off. A wrong id would
only cost routing quality: the engine tokenises the untouched request itself.

A walk over a long known prefix (a conversation's history is hundreds of chunks) rides
*express* links where it can: a chain walked before keeps, every :data:`EXPRESS_CHUNKS`
chunks from its root, the next that many chunks and a digest of the characters they span,
so a text with those characters takes them all at once (one hash instead of a key slice
and a dict lookup per chunk). A link is taken only while every chunk on it is still in
the cache (it is dropped otherwise); its chunks' recency is updated as a step-by-step walk
would.

Memory: at most ``max_chars`` characters of chunks (plus their ids and, per
:data:`EXPRESS_CHUNKS` chunks of a chain, a link's few hundred bytes), least recently used
chunks dropped first (a link goes with the chunk it starts from: its own chunks are used
after that one on every walk, so they are not dropped before it). Thread-safe: lookups and inserts run under one lock on the
router's tokenising worker threads; tokenising itself runs outside it.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

# (ids, word ids, character offsets) of a text's encoding: what the Rust tokenizer gives
Encoded = tuple[Sequence[int], Sequence[int | None], Sequence[tuple[int, int]]]

# chunks an express link spans: a walk rides one per this many chunks of a known chain
# (a few hundred characters each), so a long prefix costs a few dozen hashes, not a step
# per chunk; a text that leaves the chain inside a link walks that part step by step
EXPRESS_CHUNKS = 32


@dataclass(frozen=True)
class _Chunk:
    node: int        # this chunk's node id (its children are keyed by it)
    text: str        # the chunk's characters past its first ``anchor_chars``
    end: int         # character offset where the chunk ends in the text
    ids: np.ndarray  # the chunk's token ids, ``[n]`` uint32
    key: tuple[int, str]  # its key in ``PrefixTokens._chunks``


@dataclass(frozen=True)
class _Express:
    """The next :data:`EXPRESS_CHUNKS` chunks of a chain after one node, and what a text
    must hold to take them all: ``chars`` characters with this xxh3-128 ``digest``."""

    chunks: tuple[_Chunk, ...]
    chars: int
    digest: int
    nodes: tuple[int, ...]            # the chunks' nodes (each cached while in ``_live``)
    keys: tuple[tuple[int, str], ...]  # the chunks' keys, in walk order


def _digest(text: str) -> int:
    return xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))


def _end(chunk: _Chunk) -> int:
    return chunk.end


@dataclass(frozen=True)
class Reuse:
    """What :meth:`PrefixTokens.lookup` found for a text: the chunks whose ids are reused
    and the character offset where tokenising starts (``len(text) - start`` characters
    are left to tokenise)."""

    chunks: tuple[_Chunk, ...]
    start: int
    path: tuple[_Chunk, ...] = ()  # every chunk the walk matched (``chunks`` and one more)


class PrefixTokens:
    """A radix chain of (text chunk → token ids), one root per ``add_special_tokens``.

    A chunk is at least ``anchor_chars`` characters: it ends at the first pre-token
    boundary at or past that many characters from its start, so texts with the same
    prefix cut it at the same places, and a lookup hashes one slice of ``anchor_chars``
    characters per chunk, then compares the few characters up to the boundary."""

    def __init__(self, encode: Callable[[str, bool], Encoded], max_chars: int,
                 anchor_chars: int = 256, verify_first: int = 16,
                 verify_every: int = 256, express_chunks: int = EXPRESS_CHUNKS) -> None:
        """``encode(text, add_special_tokens)``: the tokenizer's encoding of ``text``.
        ``anchor_chars``: a chunk's least length. A prompt that repeats a known one with
        something added re-tokenises its last chunk and one whole chunk of look-ahead
        besides the new text, so short chunks cost less tokenising per request; they
        cost more entries per character held and more steps per walk. ``express_chunks``:
        the chunks an express link spans (0: no links, every walk steps chunk by chunk)."""
        if max_chars <= 0 or anchor_chars <= 0:
            raise ValueError("max_chars and anchor_chars must be > 0")
        if express_chunks < 0:
            raise ValueError("express_chunks must be >= 0")
        self.express_chunks = express_chunks
        self._encode = encode
        self.max_chars = max_chars
        self.anchor_chars = anchor_chars
        self._lock = threading.Lock()
        # (parent node, the chunk's first anchor_chars characters) -> chunks; LRU order
        self._chunks: OrderedDict[tuple[int, str], list[_Chunk]] = OrderedDict()
        self._chars = 0
        # node -> the express link from it (roots, and every EXPRESS_CHUNKS-th chunk of a
        # walked chain); a chunk's link goes when the chunk does
        self._express: dict[int, _Express] = {}
        self._live: set[int] = set()  # the nodes of the chunks cached
        self._next_node = 2  # 0 and 1: the roots without and with special tokens
        self._verify_first = verify_first
        self._verify_every = verify_every
        self._served = 0
        self.enabled = True
        self.reused_tokens = 0
        self.tokenized_tokens = 0

    def lookup(self, text: str, add_special_tokens: bool,
               after: Reuse | None = None) -> Reuse:
        """Which known prefix of ``text`` :meth:`encode` would reuse (LRU order updated).
        ``after``: a lookup, with the same ``add_special_tokens``, of a text that begins
        with the same characters as ``text`` as far as either goes (the same prompt, or
        a piece of it): its walk is resumed where it stopped instead of repeated from
        the start (a scanned prompt is looked up several times; each full walk costs a
        step per chunk of its known prefix). The caller vouches for the shared start."""
        known = after.path if after is not None else ()
        with self._lock:
            path = self._walk(int(add_special_tokens), text, known)
        reuse = tuple(path[:-1])  # the last matched chunk is the look-ahead of the one before
        return Reuse(reuse, reuse[-1].end if reuse else 0, tuple(path))

    def encode(self, text: str, add_special_tokens: bool,
               reuse: Reuse | None = None) -> np.ndarray:
        """Token ids of ``text`` (``[n]`` uint32), reusing a known prefix's ids
        (``reuse``: what :meth:`lookup` found for this text, else looked up here)."""
        if not self.enabled:
            return np.asarray(self._encode(text, add_special_tokens)[0], dtype=np.uint32)
        root = int(add_special_tokens)
        if reuse is None:
            reuse = self.lookup(text, add_special_tokens)
        chunks, start = reuse.chunks, reuse.start
        ids, words, offsets = self._encode(text[start:], add_special_tokens and not chunks)
        tail = np.asarray(ids, dtype=np.uint32)
        out = np.concatenate([*(c.ids for c in chunks), tail]) if chunks else tail
        with self._lock:
            self.reused_tokens += len(out) - len(tail)
            self.tokenized_tokens += len(tail)
            if self.enabled:
                self._add(chunks[-1].node if chunks else root, text, start, tail, words,
                          offsets)
        return out

    def should_verify(self) -> bool:
        """Whether the caller should whole-tokenise this result as a check: the first
        ``verify_first`` results, then one in ``verify_every``."""
        with self._lock:
            self._served += 1
            n = self._served
        return n <= self._verify_first or n % self._verify_every == 0

    def disable(self) -> None:
        """Stop reusing (a check found a mismatch); frees every chunk."""
        with self._lock:
            self.enabled = False
            self._chunks.clear()
            self._express.clear()
            self._live.clear()
            self._chars = 0

    @property
    def chars(self) -> int:
        """Characters of text the chunks hold."""
        return self._chars

    def _walk(self, root: int, text: str, known: Sequence[_Chunk] = ()) -> list[_Chunk]:
        """The chain of chunks ``text`` matches from ``root``, after the chunks of
        ``known`` that fit in it (a walk of a text with the same start: each chunk
        matched there matches here as far as ``text`` goes; an evicted one still holds
        the right ids). Lays the express links of the chain it stepped along."""
        path = list(known[:bisect_right(known, len(text), key=_end)])  # ends increase
        node, pos, a = root, 0, self.anchor_chars
        if path:
            node, pos = path[-1].node, path[-1].end
        stepped = -1  # where the walk first stepped chunk by chunk (-1: nowhere)
        while pos + a <= len(text):
            link = self._express.get(node)
            if link is not None and pos + link.chars <= len(text) and \
                    self._ride(node, link, text, pos):
                path += link.chunks
                node, pos = link.chunks[-1].node, link.chunks[-1].end
                continue
            key = (node, text[pos:pos + a])
            found = next((c for c in self._chunks.get(key, ())
                          if text.startswith(c.text, pos + a)), None)
            if found is None:
                break
            self._chunks.move_to_end(key)
            if stepped < 0:
                stepped = len(path)
            path.append(found)
            node, pos = found.node, found.end
        if stepped >= 0 and self.express_chunks:
            self._lay(root, path, stepped, text)
        return path

    def _ride(self, node: int, link: _Express, text: str, pos: int) -> bool:
        """Whether ``text`` at ``pos`` holds ``link``'s characters and every chunk of it
        is still cached (then they are marked used, in walk order). A link through an
        evicted chunk is dropped."""
        if _digest(text[pos:pos + link.chars]) != link.digest:
            return False
        if not self._live.issuperset(link.nodes):
            del self._express[node]
            return False
        deque(map(self._chunks.move_to_end, link.keys), maxlen=0)  # in C: no step per chunk
        return True

    def _lay(self, root: int, path: list[_Chunk], stepped: int, text: str) -> None:
        """Express links for the chain ``path`` (from ``root``) over the chunks from
        ``stepped`` on (walked one by one), where none starts yet: one from the root and
        one from every ``express_chunks``-th chunk."""
        e = self.express_chunks
        for d in range(stepped // e * e, len(path) - e + 1, e):
            node, start = (path[d - 1].node, path[d - 1].end) if d else (root, 0)
            if node not in self._express:
                end, chunks = path[d + e - 1].end, tuple(path[d:d + e])
                self._express[node] = _Express(chunks, end - start, _digest(text[start:end]),
                                               tuple(c.node for c in chunks),
                                               tuple(c.key for c in chunks))

    def _add(self, node: int, text: str, start: int, ids: np.ndarray,
             words: Sequence[int | None], offsets: Sequence[tuple[int, int]]) -> None:
        """Anchors for ``ids`` (the encoding of ``text[start:]``), chained under ``node``."""
        a = self.anchor_chars
        last_tok, last_char = 0, start
        for i in range(1, len(ids)):
            c = start + offsets[i][0]
            if c < last_char + a:
                continue
            w = words[i]
            # a pre-token starts here, and no trimmed whitespace hides where
            if w is None or w == words[i - 1] or offsets[i - 1][1] != offsets[i][0]:
                continue
            key = (node, text[last_char:last_char + a])
            rest = text[last_char + a:c]
            chunks = self._chunks.setdefault(key, [])
            chunk = next((x for x in chunks if x.text == rest), None)
            if chunk is None:
                chunk = _Chunk(self._next_node, rest, c, ids[last_tok:i].copy(), key)
                self._next_node += 1
                self._live.add(chunk.node)
                chunks.append(chunk)
                self._chars += c - last_char
            self._chunks.move_to_end(key)
            node, last_tok, last_char = chunk.node, i, c
        while self._chars > self.max_chars and self._chunks:
            _, dropped = self._chunks.popitem(last=False)
            self._chars -= sum(self.anchor_chars + len(x.text) for x in dropped)
            for x in dropped:
                self._express.pop(x.node, None)
                self._live.discard(x.node)
