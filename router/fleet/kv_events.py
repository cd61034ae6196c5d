"""vLLM and SGLang KV cache events (ZMQ, msgpack) turned into residency of *our* blocks.

vLLM publishes one ``KVEventBatch`` per scheduler step as ``(topic, seq: u64 BE, payload)``;
the payload is msgpack ``[ts, [event, ...], dp_rank]`` and each event a map tagged by
``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``extra_keys``, ``lora_name``, ``medium``), ``BlockRemoved``
(``block_hashes``, ``medium``) or ``AllBlocksCleared``. Its block hashes are vLLM's own
(sha256-based) over engine *pages* (128 tokens on CPU), so :class:`EventTranslator`
recomputes our chained xxh3 hashes over stored blocks (``block_size`` tokens, a multiple
of the page) from the token ids and the parent chain. A stored block counts as resident
while all of its pages are.

SGLang's publisher (``sglang.srt.disaggregation.kv_events``, ``--kv-events-config``) sends
the same frames and tags, one page per ``BlockStored``; the request's ``cache_salt`` is a
field of its own instead of vLLM's first extra key, and its hashes are its own (salted)
int64 page hashes. Only the engine's GPU cache is residency here (``medium`` ``GPU``, or
none: older publishers): a page a host tier holds (vLLM's CPU offloading, SGLang's
``CPU_PINNED`` HiCache) is not free to reuse, so its events are counted in
``other_media`` and left out.

Endpoints: vLLM binds its PUB socket for ``tcp://*:...`` and ``ipc://`` endpoints and
connects otherwise; the router's SUB socket does the opposite, so ``tcp://127.0.0.1:PORT``
means the router listens on loopback and every engine connects to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvcentric.hashing import extend_chain, hash_seed, root_hash, tokens_le_u32
from kvcentric.router.fleet.prefix_index import PrefixIndex

log = logging.getLogger("router.fleet.kv_events")
MAX_MESSAGE_BYTES = 64 << 20  # far above any step's batch; bounds a hostile peer's memory


@dataclass
class _Page:
    """Our chain state after one engine page.

    ``chain``: hash of the last complete stored block at or before this page;
    ``pending``: little-endian u32 tokens of the incomplete block after it;
    ``run``: engine hashes of the pages holding ``pending``.
    """

    chain: bytes
    pending: bytes
    run: tuple[Any, ...]


@dataclass(slots=True)
class _Span:
    """One ``BlockStored`` event's pages, translated once as a whole: ``buf`` is the
    pending bytes before the event (``p0`` of them) and its tokens; ``completed`` our
    blocks completed within ``buf``; a page's own state and blocks are computed from
    these when asked (a child event, a removal), not stored per page. ``pos``: each of
    the event's engine hashes to its page's position. ``later``: blocks completed by
    later events that contain one of these pages (its last pending run).

    A page is remembered as a reference to its span, its position in ``pos``: a dict of
    hashes and ints, which the garbage collector does not track, so the router's live
    pages add one tracked object per event, not one per page (each tracked object is
    visited by every full collection, and full collections run more often the more
    long-lived objects are made)."""

    chain: bytes
    buf: bytes
    p0: int
    step: int
    block: int
    completed: list[bytes]
    hashes: list[Any]
    parent_run: tuple[Any, ...]
    pos: dict[Any, int]
    later: dict[int, list[bytes]] = field(default_factory=dict)

    def state(self, i: int) -> _Page:
        """Chain state after page ``i``."""
        e = self.p0 + (i + 1) * self.step
        c = e // self.block
        pending = self.buf[c * self.block:e]
        if not pending:
            run: tuple[Any, ...] = ()
        elif c == 0:
            run = self.parent_run + tuple(self.hashes[:i + 1])
        else:
            run = tuple(self.hashes[(c * self.block - self.p0) // self.step:i + 1])
        return _Page(self.completed[c - 1] if c else self.chain, pending, run)

    def blocks(self, i: int) -> list[bytes]:
        """Our blocks that contain page ``i``."""
        s = self.p0 + i * self.step
        last = min(len(self.completed) - 1, (s + self.step - 1) // self.block)
        blocks = self.completed[s // self.block:last + 1]
        later = self.later.get(i)
        return blocks + later if later else blocks


MAX_PAGES = 1 << 18  # pages remembered per engine until its cache size is known
MAX_BLOCKS_PER_PAGE = 64  # continuations remembered per page (see EventTranslator)


class EventTranslator:
    """Per instance: engine page events -> (blocks now resident, blocks no longer resident).

    An event is translated as a whole: one chained hash over its tokens (after its
    parent page's pending ones) gives every block it completes; a page keeps only a
    reference to its event (:class:`_Span`) and its position, its state and blocks
    being computed when a child event or a removal asks (~0.3 us per page instead of
    ~4.5 us per page translated one by one, on 16-token GPU pages and 256-token blocks).

    Memory is bounded whatever the engine sends or the router misses: at most
    ``max_pages`` pages are remembered (the least recently stored forgotten first; the
    app sets it to twice the engine's cache once the engine reports its size), and each
    page at most :data:`MAX_BLOCKS_PER_PAGE` of the later blocks that contain it. A page
    forgotten here can no longer be reported removed, so its blocks stay in the index
    until its per-instance LRU drops them: stale residency is bounded, never leaked.
    """

    def __init__(self, model_id: str, block_size: int | None,
                 max_pages: int = MAX_PAGES) -> None:
        self.model_id = model_id
        self._pages: OrderedDict[Any, _Span] = OrderedDict()  # engine hash -> its span
        self.skipped = 0  # events we could not translate (unknown parent, LoRA, multimodal)
        self.other_media = 0  # events of a tier other than the GPU cache (left out)
        self.forgotten = 0  # pages dropped by the bound
        self.block_bytes = 0
        self.max_pages = max_pages
        self.reset(block_size)

    def reset(self, block_size: int | None) -> None:
        """Forget everything and name blocks of ``block_size`` tokens (``None``: not known
        yet; events are skipped until it is)."""
        self.block_bytes = (block_size or 0) * 4
        self._pages.clear()

    def __len__(self) -> int:
        return len(self._pages)

    def stored(self, ev: dict[str, Any]) -> list[bytes]:
        """Apply one ``BlockStored``; returns our blocks it completed (root first). An
        event of the wrong shape (a hostile or corrupt frame) is skipped and counted."""
        if not self._on_gpu(ev):
            return []
        hashes = ev.get("block_hashes") or []
        tokens = ev.get("token_ids") or []
        page = ev.get("block_size") or 0
        extra = ev.get("extra_keys") or []
        salt = ev.get("cache_salt")  # SGLang's; vLLM's is the first page's first extra key
        if salt is not None:
            if not isinstance(salt, str) or extra:
                self.skipped += 1
                return []
            extra = [[salt]]
        if not (_hash_list(hashes) and isinstance(tokens, list) and isinstance(extra, list)
                and _is_hash(ev.get("parent_block_hash"))
                and isinstance(page, int) and not isinstance(page, bool)):
            self.skipped += 1
            return []
        if (not self.block_bytes or not hashes or page <= 0 or len(tokens) != page * len(hashes)
                or ev.get("lora_name")):
            self.skipped += 1
            return []
        if any(k and (not isinstance(k, list) or any(not isinstance(x, str) for x in k))
               for k in extra):
            self.skipped += 1  # multimodal or embedding keys: not a plain token prefix
            return []
        state = self._start(ev.get("parent_block_hash"), extra[0] if extra else None)
        if state is None:
            self.skipped += 1
            return []
        try:
            raw = tokens_le_u32(tokens)
        except (ValueError, TypeError, OverflowError):  # not a list of token ids
            self.skipped += 1
            return []
        buf = state.pending + raw
        completed, _ = extend_chain(state.chain, buf, self.block_bytes // 4)
        span = _Span(state.chain, buf, len(state.pending), page * 4, self.block_bytes,
                     completed, hashes, state.run, dict(zip(hashes, range(len(hashes)))))
        if completed and state.pending:  # the parent's pending pages are in the first
            for prev in state.run:
                owner = self._pages.get(prev)
                if owner is not None:
                    later = owner.later.setdefault(owner.pos[prev], [])
                    later.append(completed[0])
                    if len(later) > MAX_BLOCKS_PER_PAGE:
                        del later[:len(later) - MAX_BLOCKS_PER_PAGE]
        pages = self._pages
        for vh in hashes:
            if vh in pages:
                pages.move_to_end(vh)
            pages[vh] = span
        while len(pages) > self.max_pages:
            pages.popitem(last=False)
            self.forgotten += 1
        return completed

    def _start(self, parent: Any, first_extra: Any) -> _Page | None:
        if parent is None:
            salt = next((x for x in (first_extra or ()) if isinstance(x, str)), None)
            return _Page(root_hash(hash_seed(self.model_id, salt)), b"", ())
        span = self._pages.get(parent)
        return span.state(span.pos[parent]) if span is not None else None

    def _on_gpu(self, ev: dict[str, Any]) -> bool:
        """False (counted) for an event of another tier than the engine's GPU cache."""
        medium = ev.get("medium")
        if medium is None or isinstance(medium, str) and medium.upper() == "GPU":
            return True
        self.other_media += 1
        return False

    def removed(self, ev: dict[str, Any]) -> list[bytes]:
        """Apply one ``BlockRemoved``; returns our blocks that lost a page."""
        gone: list[bytes] = []
        if not self._on_gpu(ev):
            return gone
        hashes = ev.get("block_hashes") or []
        if not _hash_list(hashes):
            self.skipped += 1
            return gone
        pop = self._pages.pop
        for vh in hashes:
            span = pop(vh, None)
            if span is not None:
                gone += span.blocks(span.pos[vh])
        return gone

    def cleared(self) -> None:
        self._pages.clear()


def apply_events(tr: EventTranslator, index: PrefixIndex, slot: int,
                 events: list[dict[str, Any]]) -> None:
    """Apply one batch's events, in order, to ``index``'s ``slot`` through ``tr``.

    vLLM sends one ``BlockRemoved`` per evicted page: a run of them is one removal from
    the index, naming each of our blocks once (every page of a block names it); a store
    or a clear after the run is applied after it, as the engine ordered them."""
    gone: set[bytes] = set()
    for ev in events:
        kind = ev.get("type")
        if kind == "BlockRemoved":
            gone.update(tr.removed(ev))
            continue
        if gone:
            index.remove(slot, gone)
            gone = set()
        if kind == "BlockStored":
            index.add(slot, tr.stored(ev))
        elif kind == "AllBlocksCleared":
            tr.cleared()
            index.clear(slot)
    if gone:
        index.remove(slot, gone)


_HASH_TYPES = frozenset((int, bytes, str))  # what msgpack decodes a hash to; not bool


def _is_hash(value: Any) -> bool:
    """vLLM block hashes are ints or bytes (None: no parent); anything else is not one."""
    return value is None or type(value) in _HASH_TYPES


def _hash_list(values: Any) -> bool:
    if type(values) is not list:
        return False
    for v in values:  # a loop, not all() over a generator: one-page removals are the bulk
        if type(v) not in _HASH_TYPES:
            return False
    return True


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one msgpack ``KVEventBatch`` payload; ``ValueError`` if malformed."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack KV event batch: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV event batch is [ts, events, dp_rank]")
    return [e for e in batch[1] if isinstance(e, dict)]


def router_binds(endpoint: str) -> bool:
    """True when the router's SUB must bind ``endpoint`` (vLLM then connects to it)."""
    engine_binds = ("*" in endpoint or "::" in endpoint
                    or endpoint.startswith(("ipc://", "inproc://")))
    return not engine_binds


class EventListener:
    """Receives one engine's event stream and hands each batch's events to ``on_events``.

    Runs as an asyncio task on the router's loop (:meth:`run`); ``gaps`` counts batches
    lost on the way (sequence jumps). With a ``replay`` endpoint (vLLM's
    ``replay_endpoint``: it keeps its last ``buffer_steps`` batches) the listener first
    asks for every buffered batch, so a (re)started router rebuilds the engine's residency
    instead of starting empty, and asks again from the last batch it has whenever it sees
    a gap; live batches already applied from a replay are skipped (``duplicates``).
    Without one, residency after a gap may be stale until the LRU or later events correct
    it. A replay that does not answer within ``replay_timeout_s`` is abandoned and
    counted in ``replay_failures``; routing goes on with what the live stream brings.
    A malformed message (wrong frame count, not msgpack, events of the wrong shape) is
    logged, counted in ``malformed`` and dropped: nothing a peer sends stops the listener.
    ZMQ drops the connection of a peer sending a message over ``MAX_MESSAGE_BYTES``; when
    the listener connected (the engine binds, vLLM's default), ZMQ never makes that
    connection again, so a socket monitor does (``reconnects``), and the sequence gap
    that follows asks for a replay.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str,
                 on_events: Callable[[list[dict[str, Any]]], None],
                 bind: bool | None = None, replay: str | None = None,
                 replay_timeout_s: float = 5.0,
                 ready: Callable[[], bool] | None = None) -> None:
        """``bind``: bind (True) or connect (False); None decides by :func:`router_binds`.
        ``replay``: the engine's replay endpoint (connected to), or None. ``ready``: no
        batch is received before it returns True (e.g. until the block size that names
        our blocks is known: applied earlier, a replay would be skipped and wasted); live
        batches wait in the socket meanwhile."""
        self.endpoint = endpoint
        self._ctx = ctx
        self._on_events = on_events
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._monitor: zmq.asyncio.Socket | None = None
        self._event: asyncio.Future[list[bytes]] | None = None
        try:
            if router_binds(endpoint) if bind is None else bind:
                self._sock.bind(endpoint)
            else:
                self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._sock.connect(endpoint)
        except zmq.ZMQError:
            self.close()  # a socket left open would hang the context's term()
            raise
        self.replay_endpoint = replay
        self.replay_timeout_s = replay_timeout_s
        self._ready = ready
        self.batches = 0
        self.gaps = 0
        self.malformed = 0
        self.replayed = 0  # batches applied from replays
        self.replay_failures = 0
        self.duplicates = 0  # live batches skipped: a replay had applied them
        self.reconnects = 0  # connections ZMQ dropped, made again
        self._last_seq: int | None = None
        self._replayed: tuple[int, int] | None = None  # seq range the last replay applied

    async def run(self) -> None:
        try:
            while self._ready is not None and not self._ready():
                await asyncio.sleep(0.05)
            if self.replay_endpoint is not None:
                await self.replay(0)
            while True:
                frames = await self._next()
                seq = _seq_of(frames)
                if seq is not None and self._replayed is not None:
                    lo, hi = self._replayed
                    if lo <= seq <= hi:
                        self.duplicates += 1
                        continue
                    self._replayed = None
                if (seq is not None and self.replay_endpoint is not None
                        and self._last_seq is not None and seq > self._last_seq + 1):
                    await self.replay(self._last_seq + 1)
                    if self._replayed is not None and seq <= self._replayed[1]:
                        self.duplicates += 1
                        continue
                self._handle(frames)
        except zmq.ZMQError as exc:  # the socket was closed under us: the instance is gone
            log.debug("%s: listener stopped: %s", self.endpoint, exc)
        finally:
            self.close()

    async def _next(self) -> list[bytes]:
        """The next live message; a dropped connection is made again meanwhile."""
        if self._monitor is None:
            return await self._sock.recv_multipart()
        recv = asyncio.ensure_future(self._sock.recv_multipart())
        try:
            while True:
                if self._event is None:
                    self._event = asyncio.ensure_future(self._monitor.recv_multipart())
                await asyncio.wait((recv, self._event), return_when=asyncio.FIRST_COMPLETED)
                if self._event.done():
                    ep = parse_monitor_message(self._event.result()).get("endpoint")
                    self._event = None
                    if isinstance(ep, bytes) and ep.decode() == self.endpoint:
                        self._sock.disconnect(self.endpoint)
                        self._sock.connect(self.endpoint)
                        self.reconnects += 1
                        log.warning("%s: the connection was dropped; made again",
                                    self.endpoint)
                if recv.done():
                    return recv.result()
        finally:
            recv.cancel()

    async def replay(self, start: int) -> int:
        """Ask the engine for its buffered batches from ``start`` on and apply them in
        order; returns how many were applied. A fresh DEALER socket per replay: a late
        answer to an abandoned one can never be mistaken for the next."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        applied = 0
        first: int | None = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await sock.poll(left * 1000):
                    raise TimeoutError(f"no end of replay in {self.replay_timeout_s:g} s")
                frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    raise ValueError(f"a replay answer of {len(frames)} frames")
                if frames[2] == _END_SEQ:
                    break
                seq = _seq_of(frames[1:])
                if self._handle(frames[1:]) and seq is not None:
                    applied += 1
                    first = seq if first is None else first
        except (TimeoutError, ValueError, zmq.ZMQError) as exc:
            self.replay_failures += 1
            log.warning("%s: replay from %s abandoned after %d batches: %s", self.endpoint,
                        self.replay_endpoint, applied, exc)
        finally:
            sock.close(linger=0)
        self.replayed += applied
        if first is not None and self._last_seq is not None:
            self._replayed = (first, self._last_seq)
        if applied:
            log.info("%s: replayed %d event batches from %s", self.endpoint, applied,
                     self.replay_endpoint)
        return applied

    def _handle(self, frames: list[bytes]) -> bool:
        """Apply one ``(topic, seq, payload)`` message; False when it was dropped."""
        seq = _seq_of(frames)
        if seq is None:
            self.malformed += 1
            log.warning("%s: dropped a message of %d frames (want topic, u64 seq, payload)",
                        self.endpoint, len(frames))
            return False
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.gaps += 1
        self._last_seq = seq
        try:
            events = decode_batch(frames[2])
            self._on_events(events)
        except Exception as exc:  # noqa: BLE001 -- a peer's bytes must never stop the loop
            self.malformed += 1
            log.warning("%s: dropped a malformed event batch: %s: %s", self.endpoint,
                        type(exc).__name__, exc)
            return False
        self.batches += 1
        return True

    def close(self) -> None:
        if self._event is not None:
            self._event.cancel()
        if self._monitor is not None:
            if not self._sock.closed:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)


_END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker


def _seq_of(frames: list[bytes]) -> int | None:
    """The sequence number of a ``(topic, seq: u64 BE, payload)`` message, else None."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")
