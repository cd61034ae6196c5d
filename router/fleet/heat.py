"""Per-prefix heat: an exponentially decayed request count per prefix root block.

A prefix is named by the hash of its first stored block (system prompts, shared
documents, agent tool definitions all start there). Heat halves every ``half_life_s``.
The router reports the hottest prefixes and on how many instances each is resident, so
the balance between reuse and spreading is visible.

Memory: a prefix whose heat has decayed below ``forget_below`` (a sixteenth of a request
by default: four half-lives after a single request) is forgotten, checked once per
half-life, so the table holds about the prefixes seen in the last few half-lives instead
of every prefix ever seen (a conversation workload starts a new root per conversation);
``max_keys`` still bounds a burst. Forgetting changes a later count by less than
``forget_below``.
"""

from __future__ import annotations

import heapq


class PrefixHeat:
    def __init__(self, half_life_s: float, max_keys: int = 10_000,
                 forget_below: float = 1 / 16) -> None:
        if half_life_s <= 0 or max_keys <= 0 or forget_below < 0:
            raise ValueError("half_life_s and max_keys must be positive, forget_below >= 0")
        self.half_life_s = half_life_s
        self.max_keys = max_keys
        self.forget_below = forget_below
        self._heat: dict[bytes, tuple[float, float]] = {}
        self._next_sweep: float | None = None

    def __len__(self) -> int:
        return len(self._heat)

    def _now_value(self, value: float, t0: float, now: float) -> float:
        return value * 0.5 ** ((now - t0) / self.half_life_s)

    def touch(self, key: bytes, now: float) -> float:
        """Count one request for ``key``; returns its heat after it."""
        value, t0 = self._heat.get(key, (0.0, now))
        heat = self._now_value(value, t0, now) + 1.0
        self._heat[key] = (heat, now)
        if self._next_sweep is None:
            self._next_sweep = now + self.half_life_s
        elif now >= self._next_sweep:
            self._forget(now)
            self._next_sweep = now + self.half_life_s
        if len(self._heat) > self.max_keys:
            self._prune(now)
        return heat

    def get(self, key: bytes, now: float) -> float:
        value, t0 = self._heat.get(key, (0.0, now))
        return self._now_value(value, t0, now)

    def top(self, k: int, now: float) -> list[tuple[bytes, float]]:
        """The ``k`` hottest prefixes, hottest first."""
        items = ((key, self._now_value(v, t0, now)) for key, (v, t0) in self._heat.items())
        return heapq.nlargest(k, items, key=lambda kv: kv[1])

    def _forget(self, now: float) -> None:
        """Drop the prefixes whose heat decayed below ``forget_below``."""
        floor = self.forget_below
        self._heat = {key: (v, t0) for key, (v, t0) in self._heat.items()
                      if self._now_value(v, t0, now) >= floor}

    def _prune(self, now: float) -> None:
        keep = dict(self.top(self.max_keys // 2, now))
        self._heat = {key: (v, now) for key, v in keep.items()}
