"""What moves in one step, as the worker sees it (no vLLM import: the worker data path
runs and is tested without vLLM; :mod:`kvcentric.connector.vllm.metadata` wraps it for
vLLM's scheduler output)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcentric.integrity import ObjectRef

SKIP = -1  # a page id that must not be written (already computed by the engine)


@dataclass
class TransferSpec:
    """Objects to move for one request in one step.

    ``refs[i]`` names one stored object (chain hash, block index, token count); every
    worker keys it in *its own* key space (each TP rank stores its own shard) and checks
    the object's header against it before unpacking. ``page_ids[i]`` are its ``k`` engine
    block ids in token order (``SKIP`` = a page the engine already has). ``parents[i]`` is
    the chain predecessor (saves only; lets the store evict leaves first).
    """

    req_id: str
    refs: list[ObjectRef]
    page_ids: list[list[int]]
    parents: list[ObjectRef | None] = field(default_factory=list)


@dataclass
class StepPlan:
    """One step's loads (before/while layers run) and saves (as layers finish).

    ``state_loads`` / ``state_saves``: a hybrid model's recurrent-state objects (one ref
    each, one page per state group; :mod:`kvcentric.connector.vllm.states`): loaded
    before the forward, saved after it. ``commit_now``: a request with saves in this step
    may finish with it, so the worker commits before the step returns instead of in the
    background.
    """

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    commit_now: bool = False
    state_loads: list[TransferSpec] = field(default_factory=list)
    state_saves: list[TransferSpec] = field(default_factory=list)


def object_pages(page_table: list[int], pages_per_object: int, first_object: int,
                 num_objects: int, first_page: int, end_page: int) -> list[list[int]]:
    """Per object from ``first_object`` on, its ``pages_per_object`` engine pages from
    ``page_table``; pages outside ``[first_page, end_page)`` (the engine's own hit, or
    past the tokens moved) are ``SKIP``."""
    k = pages_per_object
    return [[page_table[i] if first_page <= i < min(end_page, len(page_table)) else SKIP
             for i in range(b * k, (b + 1) * k)]
            for b in range(first_object, first_object + num_objects)]
