"""benchmarks/lib/report.py and benchmarks/lib/results_writer.py: the committed results render into
one deterministic REPORT.md that covers every JSON and PNG, and README's results block is
what the generator makes of the same files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.lib import report, results_writer

RESULTS = report.RESULTS


def _sections(text: str) -> dict[str, str]:
    """``## `rel``` heading -> the section's text."""
    parts = re.split(r"^## `([^`]+)`\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_report_covers_every_committed_json_and_is_deterministic(tmp_path: Path) -> None:
    def committed(suffix: str) -> list[str]:  # logs/ is the benchmarks' gitignored scratch
        rels = (p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob(f"*{suffix}"))
        return sorted(r for r in rels if not r.startswith("logs/"))

    jsons, pngs = committed(".json"), committed(".png")
    assert jsons and pngs
    outs = []
    for run in ("a", "b"):
        out = tmp_path / run / "REPORT.md"
        out.parent.mkdir()
        assert report.main(["--results", str(RESULTS), "--out", str(out), "--readme", ""]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    text = outs[0].decode()
    sections = _sections(text)
    assert sorted(sections) == jsons
    for rel, body in sections.items():  # every committed result says what, where, which code
        assert "- Command: " in body and "- Machine: " in body and "- Commit: " in body
        assert report.NOT_RECORDED not in body, f"{rel}: command, machine or commit not recorded"
    for png in pngs:  # every figure is shown, with its command and machine
        assert f"]({png})" in text
        assert re.search(rf"\*`{re.escape(png)}`[^\n]*Command: [^\n]+Machine: ", text)
    # a figure goes to the JSON with the longest matching name, not to a shorter prefix
    assert "compare_routing_seed1_ttft_cdf.png" not in sections["compare_routing.json"]
    assert "compare_routing_seed1_ttft_cdf.png" in sections["compare_routing_seed1.json"]
    assert "| kvcentric |" in sections["compare_reuse.json"]  # the arm table


def test_readme_block_is_generated_from_the_results() -> None:
    readme = report.README.read_text()
    block = report.readme_block(RESULTS)
    assert block in readme, "README's results block is stale: run `make report`"
    assert readme.count(report.BEGIN) == 1 and report.replace_block(readme, block) == readme
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    full = [p.name for p in RESULTS.glob("compare_*.json") if not p.stem.endswith("_quick")]
    assert {r.split("`")[1] for r in rows} >= set(full) | {"connectors.json"}
    with pytest.raises(ValueError, match="results:begin"):
        report.replace_block("no markers here", block)


def test_writer_records_command_machine_and_figures(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    res = tmp_path / "results"
    drawn: list[Path] = []

    def draw(p: Path) -> Path:
        shutil.copy(RESULTS / "ttft_quick.png", p)
        drawn.append(p)
        return p

    doc = {"benchmark": "demo", "title": "Demo run", "summary": {"x_ms": 12.3456, "n": 3,
                                                                  "by_arm": {"a": 1.0}}}
    paths = results_writer.write(res / "demo.json", doc, "TABLE",
                                 [results_writer.Figure("cdf", "Demo CDF", draw)],
                                 results_writer.command_line("benchmarks/demo.py", ["--x", "a b"]))
    assert paths == [res / "demo.json", res / "demo_cdf.png"] == [res / "demo.json", *drawn]
    assert "TABLE" in capsys.readouterr().out
    saved = json.loads((res / "demo.json").read_text())
    assert saved["meta"]["command"] == "python -m benchmarks.demo --x 'a b'"
    assert saved["meta"]["machine"]["cpus"] >= 1
    git = saved["meta"]["git"]  # the commit of the code that ran, and whether it differed
    assert len(git["sha"]) == 40 and isinstance(git["dirty"], bool)
    assert "benchmarks/results" not in " ".join(git["dirty_paths"])
    assert saved["figures"] == [{"file": "demo_cdf.png", "title": "Demo CDF"}]
    (res / "old.json").write_text(json.dumps({"summary": {"speed": 2.0}}))
    (res / "old_plot.png").write_bytes((RESULTS / "ttft_quick.png").read_bytes())
    (res / "stray.png").write_bytes(b"")
    (res / "logs").mkdir()
    (res / "logs" / "server-config.json").write_text("{}")  # scratch: not a result
    sections = _sections(report.render(res))
    machine = results_writer.describe_machine(saved["meta"]["machine"])
    assert "Command: `python -m benchmarks.demo --x 'a b'`" in sections["demo.json"]
    assert f"Machine: {machine}" in sections["demo.json"]
    assert "![Demo CDF](demo_cdf.png)" in sections["demo.json"]
    assert "| x_ms | 12.35 |" in sections["demo.json"]
    assert "| by_arm | 1 |" in sections["demo.json"]
    assert f"Commit: {results_writer.describe_git(git)}" in sections["demo.json"]
    assert ("- Command: not recorded\n- Machine: not recorded\n- Commit: not recorded"
            in sections["old.json"])
    assert "](old_plot.png)" in sections["old.json"]
    assert sorted(sections) == ["demo.json", "old.json"]
    assert "![stray.png](stray.png)" in report.render(res)  # claimed by no JSON, still shown
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\nrest\n")
    assert report.main(["--results", str(res), "--readme", str(readme), "--check"]) == 1
    assert report.main(["--results", str(res), "--readme", str(readme)]) == 0
    assert report.main(["--results", str(res), "--readme", str(readme), "--check"]) == 0
    assert readme.read_text().startswith("intro\n<!-- results:begin -->")
    assert readme.read_text().endswith("<!-- results:end -->\nrest\n")


def test_git_state_names_the_code_and_its_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    g = results_writer.git_state()
    assert len(g["sha"]) == 40 and g["dirty"] == bool(g["dirty_paths"])
    monkeypatch.setenv(results_writer.GIT_ENV, "0123456789abcdef0123456789abcdef01234567+dirty")
    given = results_writer.git_state()  # a device with a copy of the tree and no .git
    assert given["sha"].startswith("0123456789ab") and given["dirty"] is True
    assert results_writer.describe_git(given).startswith("0123456789ab (dirty; from $")
