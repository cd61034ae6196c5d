"""benchmarks/lib/alternate.py: each side of an alternating comparison runs its own commit's
code, and the comparison says parity exactly when the two sides' ranges meet."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.lib import alternate
from benchmarks.lib.paths import ROOT


def test_parity_is_overlapping_ranges_and_the_ratio_is_of_medians() -> None:
    base = [{"put": 1.0, "get": 2.0, "only_base": 1.0}, {"put": 1.2, "get": 2.1},
            {"put": 1.1, "get": 2.2}]
    head = [{"put": 1.15, "get": 3.0}, {"put": 1.3, "get": 3.1}, {"put": 1.25, "get": 2.9}]
    out = alternate.compare(base, head)
    assert set(out) == {"put", "get"}  # a field missing from a round is no comparison
    assert out["put"]["overlap"] and out["put"]["head_over_base"] == 1.25 / 1.1
    assert not out["get"]["overlap"] and out["get"]["base_range"] == [2.0, 2.2]
    assert out["get"]["head_median"] == 3.0


def test_a_side_imports_kvcentric_from_its_own_worktree(tmp_path: Path) -> None:
    tree = tmp_path / "side"
    sha = alternate.worktree("HEAD", tree)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        assert sha == head
        assert alternate.imports_from(tree).is_relative_to(tree.resolve())
        assert alternate.imports_from(ROOT).is_relative_to(ROOT)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       check=True)


def test_nested_summary_numbers_are_compared_by_their_path() -> None:
    """A value per prompt size (``{"added_p50_ms": {"2900": 4.1}}``) is a field of its own;
    booleans and strings are not numbers to compare."""
    got = alternate.numeric({"added_p50_ms": {"2900": 4.1, "10": 2}, "meets": True,
                             "name": "x", "ratio": 0.9, "deep": {"a": {"b": 1}}})
    assert got == {"added_p50_ms.2900": 4.1, "added_p50_ms.10": 2.0, "ratio": 0.9,
                   "deep.a.b": 1.0}
