"""A capacity sweep's finished points on disk, so an interrupted sweep resumes where it
stopped instead of starting again.

An emulated sweep runs for hours (every point is a fleet serving 1,000+ requests, several
arms, repetitions); a session's end, a crash or a kill -9 must not throw away the points
already measured. :class:`SavedPoints` stands in front of an
:class:`~benchmarks.serving.slo_capacity.Engine`: each point it runs is appended to a JSON
lines file at once (its rate row, its counted outcomes, the fleet numbers and per-request
rows the engine recorded for it), and a point already in the file is answered from it.

The file's first line names the run it belongs to (:func:`run_key`: the arguments that
shape a point, the simulator's configuration and the code's commit); a file of another
run is refused with the fields that differ, never mixed in. Points are keyed by arm,
offered rate and repetition, so a rerun with more arms, rates or repetitions reuses what
it shares with the first. A torn last line (the writer killed mid-append) is dropped;
a second sweep on a file in use is refused (``FILE.lock``, flock).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from benchmarks.lib import capacity as cap
from benchmarks.lib import results_writer as rw

VERSION = 1
# the arguments that change what one point measures (reps, rates, arms and where the
# result goes only choose which points run)
POINT_ARGS = ("workload", "instances", "engine", "requests", "warmup", "slo_ttft_s",
              "slo_tbt_s", "seed", "trace_dir", "profile", "pages", "dilation",
              "max_output", "scale_tokens", "max_model_len")


class PointEngine(Protocol):
    """What :class:`SavedPoints` wraps (the sweep's engine): ``runs`` and ``request_log``
    are what ``point`` appends per run (tuples where an engine records none)."""

    arms: list[str]
    runs: Any
    request_log: Any

    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]: ...


def run_key(args: argparse.Namespace) -> dict[str, Any]:
    """What identifies a sweep's points: :data:`POINT_ARGS`, the simulator configuration
    ``args.cfg`` and the commit of the code (and whether the tree differed from it)."""
    git = rw.git_state()
    return {"version": VERSION,
            "args": {k: str(v) if isinstance(v, Path) else v
                     for k, v in sorted(vars(args).items()) if k in POINT_ARGS},
            "cfg": asdict(args.cfg), "git": {"sha": git["sha"], "dirty": git["dirty"]}}


class SavedPoints:
    """``engine``'s points through the file at ``path`` (created, with ``key`` as its
    first line, when missing). ``ValueError`` when the file belongs to another run or is
    not such a file. Not thread-safe: one sweep owns the file."""

    def __init__(self, engine: PointEngine, path: Path, key: dict[str, Any]) -> None:
        self.engine = engine
        self.arms = engine.arms
        self.path = path
        self.reused = 0  # points given out from the file rather than run
        # (arm, rate, rep) -> {"row", "outs", "runs", "requests"}: every point in the file
        self.saved: dict[tuple[str, float, int], dict[str, Any]] = {}
        self._given: set[tuple[str, float, int]] = set()
        path.parent.mkdir(parents=True, exist_ok=True)
        # held while this object lives (the process, for a sweep): a second sweep started
        # on the same file would interleave its points with this one's
        self._lock = path.with_name(path.name + ".lock").open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(f"{path}: another sweep is using it") from None
        try:
            if path.exists() and path.stat().st_size:
                self._load(key)
            else:
                self._append({"key": key})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let another sweep use the file (also when this process ends)."""
        self._lock.close()

    def __enter__(self) -> SavedPoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self, key: dict[str, Any]) -> None:
        lines = self.path.read_bytes().split(b"\n")
        try:
            head = json.loads(lines[0])["key"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{self.path}: not a sweep's saved points (no key line)") from None
        if head != key:
            diff = sorted(_differences(head, key))
            raise ValueError(f"{self.path}: saved by another run (differs in "
                             f"{', '.join(diff)}); remove it or give another path")
        good = 1
        for i, line in enumerate(lines[1:], 1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
                k = (str(p["arm"]), float(p["rate"]), int(p["rep"]))
                p["outs"] = [cap.Served(*o) for o in p["outs"]]
            except (ValueError, KeyError, TypeError):
                if i == len(lines) - 1 or all(not x.strip() for x in lines[i + 1:]):
                    break  # torn by a kill mid-append: that point runs again
                raise ValueError(f"{self.path}: line {i + 1} is not a saved point") from None
            self.saved[k] = p
            good = i + 1
        if good < len(lines) and any(x.strip() for x in lines[good:]):
            # cut the torn tail so the next append starts a line of its own
            with self.path.open("r+b") as f:
                f.truncate(sum(len(x) + 1 for x in lines[:good]))

    def _append(self, obj: dict[str, Any]) -> None:
        with self.path.open("ab") as f:
            f.write(json.dumps(obj, separators=(",", ":"), default=_plain).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]:
        """The point from the file when saved (the engine's ``runs`` and ``request_log``
        get its records the first time it is given out), else run and saved at once."""
        k = (arm, float(rate), int(rep))
        p = self.saved.get(k)
        if p is None:
            runs, log = len(self.engine.runs), len(self.engine.request_log)
            row, outs = self.engine.point(arm, rate, rep)
            p = {"arm": arm, "rate": float(rate), "rep": int(rep), "row": row,
                 "outs": outs, "runs": list(self.engine.runs[runs:]),
                 "requests": list(self.engine.request_log[log:])}
            self._append({**p, "outs": [list(asdict(o).values()) for o in outs]})
            self.saved[k] = p
        elif k not in self._given:
            self.reused += 1
            if isinstance(self.engine.runs, list):
                self.engine.runs.extend(p["runs"])
            if isinstance(self.engine.request_log, list):
                self.engine.request_log.extend(p["requests"])
        self._given.add(k)
        return dict(p["row"]), list(p["outs"])


def _plain(x: Any) -> Any:
    """numpy scalars (a row's statistics may be) as the Python numbers they hold."""
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def _differences(a: Any, b: Any, at: str = "") -> list[str]:
    """Dotted paths where two key documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in _differences(a.get(k), b.get(k), f"{at}.{k}" if at else str(k))]
    return [] if a == b else [at or "key"]
