"""Every measured number in README.md and docs/*.md comes from a result file (or a test).

A number with a unit (ms, s, µs, GB/s, MiB, x, %, req/s, ...) is a claim. The block it
sits in (a paragraph, a list item, or a table row with the paragraph that introduces the
table) must cite where it comes from: ``results/NAME.json`` (a committed result; globs
allowed) or ``tests/NAME.py`` (a bound a test asserts). Each number must then be found
there: in a cited result as one of its values, in one of the usual unit conversions, to
the precision shown (a range's both ends); in a cited test as a literal of its source;
or as the ratio, or percent difference, of two other numbers of the same block that are
found. README's results block is generated from the results (``make report``) and is left
out here (tests/bench/test_report.py holds it). Numbers that are not measurements (defaults,
limits, sizes of things) are listed in :data:`CONSTANTS` with what they are.
"""

from __future__ import annotations

import bisect
import glob
import json
import math
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UNIT = r"(?:ms|µs|us|s|GB/s|GiB/s|MB/s|MiB|GiB|KiB|MB|GB|x|×|%|req/s|k/s|/s)"
NUM = r"[-+−]?\d[\d,]*(?:\.\d+)?"
CLAIM = re.compile(rf"(?<![\w.\-/=])({NUM})(?:\s?[–-]\s?({NUM}))?\s?({UNIT})(?![\w/])")
CITE_RESULT = re.compile(r"results/([\w.*-]+\.json)")
CITE_TEST = re.compile(r"\b(tests/[\w/]+\.py)")
GENERATED = re.compile(r"<!-- results:begin -->.*?<!-- results:end -->", re.S)
SCALES = (1.0, 1e3, 1e-3, 1e6, 1e-6, 100.0, 1 / 2**20, 1 / 2**30, 1 / 2**10, 1e-9)

# Numbers that are not measurements: defaults, limits and sizes the text describes.
# (document, the number as written) -> what it is.
CONSTANTS: dict[tuple[str, str], str] = {
    ("README.md", "2 s"): "router: how long a POST /instances waits for its event port; "
                          "the dashboard's poll interval",
    ("README.md", "4 MiB"): "router: the default body limit",
    ("README.md", "256 MiB"): "Mooncake's default offload bucket",
    ("docs/router.md", "64 MiB"): "ZMQ's largest KV-event message",
    ("docs/router.md", "5 s"): "router: metrics poll interval, replay time limit, uvicorn's "
                               "keep-alive",
    ("docs/router.md", "4 s"): "router: how long an idle engine connection is kept",
    ("docs/router.md", "60 s"): "router: memory.trim_interval_s default",
    ("docs/router.md", "0.25 s"): "store view: wait_s and the absent-answer TTL",
    ("docs/router.md", "2 s"): "store view: store_ttl_s; the dashboard's poll interval",
    ("docs/store.md", "64 MiB"): "the coordinator's largest frame and unsent-reply bound",
    ("docs/store.md", "30 s"): "coordinator: stats line interval",
    ("docs/store.md", "300 s"): "lease_ttl_s default",
    ("docs/store.md", "16 KiB"): "shared index: arena bytes per slot",
    ("docs/store.md", "3 s"): "shared index: heartbeat age limit",
    ("docs/store.md", "4 KiB"): "disk tier: file header and rounding; O_DIRECT alignment",
    ("docs/store.md", "1 s"): "disk tier: demotion pause after an error",
    ("docs/store.md", "4 MiB"): "the O_DIRECT trial's object size",
    ("docs/store.md", "128 KiB"): "the O_DIRECT trial's range size",
    ("docs/store.md", "256 MiB"): "Mooncake's default offload bucket; staging_size",
}


def blocks(text: str) -> Iterator[tuple[int, str, str]]:
    """(line, block, context) per block of ``text``: paragraphs, list items and table rows;
    a table row's context is the paragraph before its table, else the context is empty."""
    lines = text.split("\n")
    cur: list[str] = []
    start, intro, last_para = 0, "", ""
    in_code = False

    def flush() -> Iterator[tuple[int, str, str]]:
        nonlocal cur, last_para
        if cur:
            block = "\n".join(cur)
            yield start, block, ""
            last_para = block
        cur = []

    for i, line in enumerate(lines, 1):
        if line.startswith("```"):
            yield from flush()
            in_code = not in_code
            continue
        if in_code:
            continue  # commands and configs, not claims
        if line.startswith("|"):
            yield from flush()
            if not intro:
                intro = last_para
            yield i, line, intro
            continue
        intro = ""
        if not line.strip() or line.startswith("#"):
            yield from flush()
            continue
        if re.match(r"\s*([-*]|\d+\.)\s", line):
            yield from flush()
        if not cur:
            start = i
        cur.append(line)
    yield from flush()


@cache
def leaves(name: str) -> tuple[float, ...]:
    """Every number in result ``name`` (a JSON under benchmarks/results/)."""
    out: list[float] = []

    def walk(x: object) -> None:
        if isinstance(x, bool):
            return
        if isinstance(x, int | float):
            if math.isfinite(x):
                out.append(float(x))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads((RESULTS / name).read_text()))
    return tuple(out)


def value(text: str) -> tuple[float, int]:
    """(value, decimals shown) of a number as written."""
    t = text.replace(",", "").replace("−", "-")
    return float(t), len(t.split(".")[1]) if "." in t else 0


def shown_as(v: float, target: float, decimals: int) -> bool:
    return abs(round(v, decimals) - target) <= 0.5 * 10 ** -decimals + 1e-9


@cache
def _transformed(name: str, kind: float | str) -> list[float]:
    """Result ``name``'s numbers times the scale ``kind``, or as a percent difference from
    1 (``"pct"``) or inverted (``"inv"``), sorted: a claim is then looked up by bisection
    (the results hold ~10^6 numbers; comparing each claim with every one took 8 minutes)."""
    vals = leaves(name)
    if kind == "pct":
        xs = [100 * (v - 1) for v in vals]
    elif kind == "inv":
        xs = [1 / v for v in vals if v]
    else:
        assert isinstance(kind, float)
        xs = [v * kind for v in vals]
    return sorted(x for x in xs if math.isfinite(x))


def in_result(target: float, decimals: int, unit: str, name: str) -> bool:
    """Whether a number of result ``name``, in one of the unit conversions, is ``target``
    (or its negation) shown to ``decimals`` places."""
    kinds: list[float | str] = [*SCALES, *(("pct", "inv") if unit in ("%", "x", "×") else ())]
    # a value shown as t lies within half a unit of the last place of t: look a little wider
    # and let shown_as decide
    width = 1.01 * 10 ** -decimals + 1e-9
    for kind in kinds:
        xs = _transformed(name, kind)
        for t in (target, -target):
            for c in xs[bisect.bisect_left(xs, t - width):bisect.bisect_right(xs, t + width)]:
                if shown_as(c, target, decimals) or shown_as(c, -target, decimals):
                    return True
    return False


def in_test(text: str, path: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(text)}(?![\d])", (ROOT / path).read_text()) \
        is not None


def derived(target: float, decimals: int, unit: str, found: list[float]) -> bool:
    """Whether ``target`` is a ratio (x) or percent difference (%) of two found numbers."""
    if unit not in ("%", "x", "×"):
        return False
    for a in found:
        for b in found:
            if a and b and a != b:
                r = a / b
                if shown_as(r, target, decimals) or shown_as(100 * (r - 1), target, decimals) \
                        or shown_as(100 * r, target, decimals):
                    return True
    return False


def claims() -> list[tuple[str, int, str, str]]:
    """(document, line, number as written, citing text) of every claim."""
    out = []
    for doc in DOCS:
        text = GENERATED.sub("", doc.read_text())
        rel = doc.relative_to(ROOT).as_posix()
        for line, block, intro in blocks(text):
            for m in CLAIM.finditer(block):
                out.append((rel, line, m.group(0), block + "\n" + intro))
    return out


def check(doc: str, line: int, claim: str, scope: str) -> str | None:
    """Why ``claim`` is not backed, or None."""
    if (doc, claim) in CONSTANTS:
        return None
    results = sorted({Path(p).name for pat in CITE_RESULT.findall(scope)
                      for p in glob.glob(str(RESULTS / pat))})
    tests = [t for t in CITE_TEST.findall(scope) if (ROOT / t).is_file()]
    if not results and not tests:
        return f"{doc}:{line}: {claim!r} cites no result file or test"
    m = CLAIM.fullmatch(claim) or CLAIM.search(claim)
    assert m is not None
    unit = m.group(3)
    nums = [g for g in (m.group(1), m.group(2)) if g]
    found: list[float] = []
    for nm in CLAIM.finditer(scope):
        for g in (nm.group(1), nm.group(2)):
            if g and g not in nums:
                v, d = value(g)
                if any(in_result(v, d, nm.group(3), r) for r in results):
                    found.append(v)
    for n in nums:
        v, d = value(n)
        if any(in_result(v, d, unit, r) for r in results):
            continue
        if any(in_test(n, t) for t in tests):
            continue
        if derived(v, d, unit, found):
            continue
        return (f"{doc}:{line}: {claim!r} is in none of {results + tests} (nor a ratio of "
                "the block's other numbers)")
    return None


def test_every_number_comes_from_a_result_or_a_test() -> None:
    problems = [p for c in claims() if (p := check(*c)) is not None]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_unbacked_numbers() -> None:
    name = "integrity.json"
    doc = json.loads((RESULTS / name).read_text())
    assert leaves(name) and doc
    ok = f"A header check costs X (`results/{name}`)."
    some = next(v for v in leaves(name) if 1 < v < 1000)
    claim = f"{some:.1f} ms"
    assert check("x.md", 1, claim, ok.replace("X", claim)) is None \
        or check("x.md", 1, f"{some * 1e-3:.4f} s", ok) is None
    assert "cites no result" in (check("x.md", 1, "12.5 ms", "It takes 12.5 ms.") or "")
    assert "is in none of" in (check("x.md", 1, "987654.3 ms", ok.replace("X", "987654.3 ms"))
                               or "")
    # a ratio of two numbers of the same block that are found
    a, b = sorted(v for v in leaves(name) if v > 1)[-2:]
    scope = f"{a:.1f} ms vs {b:.1f} ms ({a / b:.3f}x, `results/{name}`)"
    assert check("x.md", 1, f"{a / b:.3f}x", scope) is None


@pytest.mark.parametrize("text,blocks_expected", [
    ("para one\nstill one\n\n- item a\n  more a\n- item b\n\n| h |\n|---|\n| r |\n", 6),
])
def test_blocks(text: str, blocks_expected: int) -> None:
    got = list(blocks(text))
    assert len(got) == blocks_expected
    assert got[0][1] == "para one\nstill one" and got[1][1] == "- item a\n  more a"
    assert got[-1] == (10, "| r |", "- item b")


# The claims issue 33 named, checked number by number against their files.

def _result(name: str) -> dict[str, Any]:
    return dict(json.loads((RESULTS / name).read_text()))


def _paragraph(doc: Path, marker: str) -> str:
    text = doc.read_text()
    hits = [b for _, b, _ in blocks(text) if marker in b]
    assert len(hits) == 1, f"{doc.name}: {len(hits)} blocks with {marker!r}"
    return " ".join(hits[0].split())


def test_readme_demo_numbers_are_demo_json() -> None:
    d = _result("demo.json")["summary"]
    text = _paragraph(ROOT / "README.md", "benchmarks/results/demo.json")
    later = " / ".join(f"{v:.0f} ms" for v in d["later_mean_ms"].values())
    speed = " and ".join(f"{v:.1f}x" for v in d["speedup_over_first"].values())
    assert later in text and f"({speed} faster)" in text, (later, speed, text)
    assert d["tokens_identical"] and "identical tokens in every arm" in text


def test_readme_connectors_claim_is_parity_with_the_spread() -> None:
    s = _result("connectors.json")["summary"]
    assert s["verdict_kvcentric_vs_mooncake_store_connector"] == "parity"
    runs = s["ttft_mean_ms_by_repeat"]
    text = _paragraph(ROOT / "README.md", "results/connectors.json")
    assert "parity" in text
    for arm in ("mooncake_store_connector", "kvcentric"):
        lo, hi = min(runs[arm]), max(runs[arm])
        assert f"{lo:.0f}-{hi:.0f} ms" in text, (arm, lo, hi)
    assert "(0.978x" not in text  # the mean ratio of overlapping repetitions is no lead


def test_readme_glibc_soak_claim_is_soak_vllm_alone_json() -> None:
    s = _result("soak_vllm_alone.json")["summary"]
    text = _paragraph(ROOT / "README.md", "results/soak_vllm_alone.json")
    for engine in ("engine0", "engine1"):
        a, b = s["rss_mib_start_end"][engine]
        assert f"{a} -> {b} MiB" in text, engine
    slopes = s["rss_slope_mib_per_1k_requests"]
    assert f"{slopes['engine0']:.2f} and {slopes['engine1']:.2f} MiB per 1000" in text
    assert f"{s['failed']} of its {s['requests']:,} requests failed" in text


def test_docs_streamed_vs_whole_loads_are_connectors_quick_json() -> None:
    s = _result("connectors_quick.json")["summary"]
    assert s["verdict_kvcentric_vs_kvcentric_whole_get"] == "parity"
    later, runs = s["ttft_later_turns_mean_ms"], s["ttft_mean_ms_by_repeat"]
    text = _paragraph(ROOT / "docs" / "store.md", "`kvcentric_whole_get`")
    assert "parity" in text and "1128" not in text  # no number without a file
    assert f"{later['kvcentric']:.0f} vs {later['kvcentric_whole_get']:.0f} ms" in text
    for arm in ("kvcentric", "kvcentric_whole_get"):
        assert f"{min(runs[arm]):.0f}-{max(runs[arm]):.0f}" in text, arm


def test_readme_reports_a_writer_arm_only_if_its_own_counters_show_saves() -> None:
    rows = _result("ttft_writer.json")["rows"]
    text = _paragraph(ROOT / "README.md", "results/ttft_writer.json")
    for arm in ("kvc", "lmcache"):
        saved = [x for r in rows for x in r.get(f"{arm}_saved", r.get(f"{arm}_saved_blocks", []))]
        valid = bool(saved) and all(x > 0 for x in saved) \
            and not any(f"{arm}_invalid" in r for r in rows)
        if arm == "lmcache" and not valid:
            assert not re.search(r"LMCache [+-]\d", text), "LMCache's writer numbers, unproven"
        if arm == "kvc":
            assert valid, "our writer arm saved nothing by its own counters"
