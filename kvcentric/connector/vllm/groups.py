"""The KV cache groups of an engine and what each contributes to a prefix hit.

vLLM's hybrid KV cache manager (``SupportsHMA``) gives every kind of layer its own KV
cache group with its own block table: full attention keeps every page of a request,
sliding-window attention keeps only the pages of its last window (older entries of its
block table are the *null block*, id 0), and a recurrent group (Mamba, short conv,
``MambaSpec``) keeps its *state* at block boundaries (mamba cache mode ``align``: entry
``j`` holds the state after ``(j + 1) * block_size`` tokens). A single-group model is
the special case of one full-attention (or MLA) group.

How kvcentric stores them (docs/connector.md §Hybrid models (HMA)):

- **Block objects** hold, per stored block, every *attention* layer (full and sliding
  groups) in model order: ``[header][L_att][k][page_bytes]``, each layer's ``k`` pages
  taken from its own group's block table. A sliding group writes every block it
  completes (any block can be inside the window of a later hit) and loads only the
  pages of the window before the hit's end; pages it does not hold (null) are never
  read or written.
- **State objects** hold the state of every recurrent layer at one block boundary:
  ``[header][L_state][1][state_bytes]`` (the state's bytes in its page, padding left
  out), keyed by the chain hash of the block that ends at the boundary (``s-`` keys,
  header kind 2). A hit of a model with a state group ends where a state is stored
  (block aligned; no tail), or reports no hit: vLLM recomputes.

A group this module cannot serve makes the whole engine answer no hits (loud warning):
recompute, never a wrong token. Nothing here imports vLLM: groups are read from
``kv_cache_config`` by attribute and class name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcentric.connector.vllm.transfers import SKIP

NULL_BLOCK = 0  # vLLM's BlockPool hands block 0 out as the null block, never as a page
FULL, SLIDING, STATE = "full", "sliding", "state"
_KINDS = {"FullAttentionSpec": FULL, "MLAAttentionSpec": FULL,
          "SlidingWindowSpec": SLIDING, "SlidingWindowMLASpec": SLIDING, "MambaSpec": STATE}


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups, as the connector sees it.

    ``index``: vLLM's group id (the position of its block table in ``get_block_ids()``);
    ``kind``: ``full``, ``sliding`` or ``state``; ``block_size``: engine tokens per page;
    ``window``: the sliding window in tokens (``sliding`` only); ``page_bytes``: bytes of
    one page of one layer that we store (a state's content without vLLM's padding).
    """

    index: int
    kind: str
    block_size: int
    layers: tuple[str, ...]
    page_bytes: int
    window: int = 0
    describe: str = ""  # what else decides its bytes (state shapes and dtypes)

    def first_live_page(self, computed: int) -> int:
        """The first page this group still holds once ``computed`` tokens are computed
        (vLLM's ``get_num_skipped_tokens``): 0 for full attention; for a sliding window
        the page of token ``computed - window + 1``, the first one the next token's
        attention reads."""
        if self.kind != SLIDING:
            return 0
        return max(0, computed - self.window + 1) // self.block_size


@dataclass(frozen=True)
class GroupPlan:
    """The stored groups of one engine and how their pages map onto objects.

    ``attention``: groups whose pages make up block objects; ``layers``: their layers in
    object (model) order; ``layer_group[i]``: which ``attention`` entry layer ``i``
    belongs to (None with one attention group: every layer uses the same page ids, the
    single-group path). ``states``: recurrent groups (state objects of ``state_layers``).
    ``unservable``: why this engine's hits cannot be served ("" when they can).
    """

    attention: tuple[CacheGroup, ...]
    layers: tuple[str, ...]
    layer_group: tuple[int, ...] | None
    states: tuple[CacheGroup, ...] = ()
    state_layers: tuple[str, ...] = ()
    unservable: str = ""

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group: vLLM then takes load failures only per request
        (``failed_recving`` of an asynchronous load), never as block ids."""
        return len(self.attention) + len(self.states) > 1

    @property
    def page_size(self) -> int:
        return self.attention[0].block_size

    def signature(self) -> str:
        """What the groups add to the layout signature ("" for one full-attention group,
        so a single-group model keeps its keys)."""
        if not self.hybrid and self.attention[0].kind == FULL:
            return ""
        parts = [f"{g.kind}:{g.window}:{g.block_size}:{g.page_bytes}:{g.describe}:"
                 + ",".join(_layer_ids(g.layers)) for g in (*self.attention, *self.states)]
        return "|".join(parts)

    # ---- page ids of one request (scheduler side) ----
    def load_pages(self, tables: Sequence[Sequence[int]], first_object: int, num_objects: int,
                   k: int, first_page: int, end_page: int, end_tokens: int) -> list[list[int]]:
        """Per object from ``first_object`` on, the engine pages its load writes: ``k`` per
        attention group, concatenated in ``attention`` order. A page outside
        ``[first_page, end_page)`` (the engine's own hit, or past the tokens moved), one a
        sliding group no longer holds at ``end_tokens`` and a null entry are ``SKIP``."""
        out: list[list[int]] = []
        for b in range(first_object, first_object + num_objects):
            ids: list[int] = []
            for g in self.attention:
                table, lo = tables[g.index], max(first_page, g.first_live_page(end_tokens))
                ids += [table[i] if lo <= i < min(end_page, len(table))
                        and table[i] != NULL_BLOCK else SKIP for i in range(b * k, (b + 1) * k)]
            out.append(ids)
        return out

    def save_pages(self, tables: Sequence[Sequence[int]], block: int, k: int,
                   first_page: int = 0, end_page: int | None = None) -> list[int] | None:
        """The pages of stored block ``block`` in every attention group (``k`` each); with
        ``end_page`` (a tail), pages outside ``[first_page, end_page)`` are ``SKIP``. None
        when a group does not hold one of the others (null or not allocated: saving it
        would store another page's bytes)."""
        ids: list[int] = []
        for g in self.attention:
            table = tables[g.index]
            for i in range(block * k, (block + 1) * k):
                if end_page is not None and not first_page <= i < end_page:
                    ids.append(SKIP)  # a tail's page past its last token
                elif i >= len(table) or table[i] == NULL_BLOCK:
                    return None
                else:
                    ids.append(table[i])
        return ids

    def state_page(self, tables: Sequence[Sequence[int]], boundary: int) -> list[int] | None:
        """The page holding every state group's state after ``boundary`` tokens (entry
        ``boundary / block_size - 1`` of its table: mode ``align``), one per state group;
        None when one is null or missing."""
        ids = []
        for g in self.states:
            table, i = tables[g.index], boundary // g.block_size - 1
            if i < 0 or i >= len(table) or table[i] == NULL_BLOCK:
                return None
            ids.append(table[i])
        return ids


def _layer_ids(names: Sequence[str]) -> list[str]:
    return [str(_layer_number(n)) for n in names]


def _layer_number(name: str) -> int:
    """The layer index in a vLLM layer name (``model.layers.12.self_attn.attn`` -> 12),
    the order vLLM runs them in; names without one sort last, by name."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return 1 << 30


def _page_bytes(spec: Any) -> int:
    return int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))


def _describe_state(spec: Any) -> str:
    shapes = ";".join("x".join(str(d) for d in s) for s in spec.shapes)
    dtypes = ";".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return f"{getattr(spec, 'mamba_type', '')}/{shapes}/{dtypes}".replace("|", "/")


def group_plan(kv_cache_config: Any, stored_block_size: int) -> GroupPlan:
    """The stored groups of ``kv_cache_config`` (vLLM's ``KVCacheConfig``).

    Raises ``ValueError`` for a group kind kvcentric does not know (chunked local or
    cross attention, ...: a wrong guess would load wrong bytes), for attention groups of
    different page sizes, and for a stored block size that is not a page multiple. A
    state group that cannot be served (mode other than ``align``, speculative or
    prefill-checkpoint blocks, another block size, a stored block of several pages)
    sets ``unservable``.
    """
    attention: list[CacheGroup] = []
    states: list[CacheGroup] = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue  # an ephemeral replica vLLM rebuilds from its source group
        spec = g.kv_cache_spec
        kind = _KINDS.get(type(spec).__name__)
        if kind is None:
            raise ValueError(f"kvcentric cannot store KV cache group {i} "
                             f"({type(spec).__name__})")
        window = int(spec.sliding_window) if kind == SLIDING else 0
        describe = _describe_state(spec) if kind == STATE else ""
        group = CacheGroup(i, kind, int(spec.block_size), tuple(g.layer_names),
                           _page_bytes(spec), window, describe)
        (states if kind == STATE else attention).append(group)
    if not attention:
        raise ValueError("kvcentric needs at least one attention KV cache group")
    page = attention[0].block_size
    if any(g.block_size != page or g.page_bytes != attention[0].page_bytes
           for g in attention):
        raise ValueError("kvcentric needs attention KV cache groups of one page size, got "
                         + ", ".join(f"{g.block_size} tokens/{g.page_bytes} B"
                                     for g in attention))
    if stored_block_size % page:
        raise ValueError(f"stored block size {stored_block_size} is not a multiple of the "
                         f"engine page size {page}")
    named = sorted(((_layer_number(n), n, j) for j, g in enumerate(attention)
                    for n in g.layers))
    layers = tuple(n for _, n, _ in named)
    layer_group = tuple(j for _, _, j in named) if len(attention) > 1 else None
    state_layers = tuple(n for _, n in sorted((_layer_number(n), n)
                                               for g in states for n in g.layers))
    unservable = ""
    for g, spec in ((g, kv_cache_config.kv_cache_groups[g.index].kv_cache_spec)
                    for g in states):
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            unservable = (f"group {g.index} keeps its state in mamba cache mode {mode!r}: "
                          "only 'align' (prefix caching on) keeps states at block bounds")
        elif getattr(spec, "num_speculative_blocks", 0) or \
                getattr(spec, "num_prefill_checkpoint_blocks", 0):
            unservable = (f"group {g.index} relocates its state blocks (speculative or "
                          "prefill-checkpoint blocks)")
        elif g.page_bytes != states[0].page_bytes:
            unservable = f"recurrent groups of different state sizes ({g.index})"
        elif g.block_size != page or stored_block_size != page:
            unservable = (f"group {g.index} keeps a state every {g.block_size} tokens; the "
                          f"stored block is {stored_block_size} tokens of {page}-token pages")
    return GroupPlan(tuple(attention), layers, layer_group, tuple(states), state_layers,
                     unservable)
