"""benchmarks/README.md is what ``python -m benchmarks.lib.index`` makes of the benchmarks'
docstrings and the committed results; every benchmark states its question and command;
every result names a benchmark that exists; nothing under benchmarks/ or examples/ edits
``sys.path``."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from benchmarks.lib import index
from benchmarks.lib.paths import RESULTS, ROOT


def test_readme_is_generated_from_the_docstrings_and_results() -> None:
    assert index.README.read_text() == index.render(), \
        "benchmarks/README.md is stale: run `python -m benchmarks.lib.index`"
    assert index.main(["--check"]) == 0


def test_every_benchmark_states_its_question_and_command() -> None:
    es = index.entries()
    names = {e.module for e in es}
    assert {"benchmarks.micro.store", "benchmarks.serving.compare", "benchmarks.sim.routing",
            "benchmarks.reliability.faults", "benchmarks.lib.report"} <= names
    for e in es:
        assert importlib.util.find_spec(e.module) is not None, e.module
        path = ROOT / (e.module.replace(".", "/") + ".py")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.split("\n\n")[0]
        assert first == e.summary and "\n" not in first and first, \
            f"{e.module}: the docstring must open with one line of its own"
        if e.benchmark:
            assert e.summary.endswith("?"), f"{e.module}: its first line is its question"
            assert e.usage, f"{e.module}: its usage block names `python -m {e.module}`"
        else:
            assert e.summary.endswith("."), e.module
    assert len(names) == len(es)


def test_every_result_names_a_benchmark_that_exists() -> None:
    modules = {e.module for e in index.entries()}
    docs = index.result_docs()
    assert docs
    for rel, doc in docs:
        meta = doc.get("meta")
        command = meta.get("command") if isinstance(meta, dict) else None
        assert command, f"{rel} records no command"
        mod = index.producer(str(command))
        if mod is not None:
            assert mod in modules, f"{rel}: its command runs {mod}, which is gone"
        else:  # made by a test or an example: the file it names exists
            m = re.search(r"(tests/[\w/]+\.py)|-m (examples\.[\w.]+)", str(command))
            assert m, (rel, command)
            if m.group(1):  # tests moved into folders since: the file by its name
                assert list((ROOT / "tests").rglob(Path(m.group(1)).name)), (rel, command)
            else:
                assert (ROOT / (m.group(2).replace(".", "/") + ".py")).is_file(), (rel, command)
    assert index.producer("python benchmarks/bench_store.py --quick") == "benchmarks.micro.store"
    assert index.producer("A=b python -m benchmarks.sim.routing --x") == "benchmarks.sim.routing"
    assert index.producer("python -m pytest tests/e2e/test_router_e2e.py") is None


def test_the_benchmarks_are_packages_that_never_edit_sys_path() -> None:
    for folder in (ROOT / "benchmarks", ROOT / "examples"):
        for path in folder.rglob("*.py"):
            if RESULTS in path.parents or "mooncake_timing" in path.parts:
                continue  # mooncake_timing is a sitecustomize directory, not a package
            text = path.read_text()
            assert not re.search(r"sys\.path\.(insert|append)|sys\.path\s*=", text), path
            if folder.name == "benchmarks":
                assert (path.parent / "__init__.py").is_file(), f"{path.parent} is no package"


def test_an_index_of_a_made_up_tree(tmp_path: Path) -> None:
    bench = tmp_path / "benchmarks" / "micro"
    bench.mkdir(parents=True)
    (bench / "__init__.py").write_text("")
    (bench / "thing.py").write_text(
        '"""How fast is a thing?\n\n    python -m benchmarks.micro.thing [--quick]\n\nMore.\n"""\n'
        'if __name__ == "__main__":\n    pass\n')
    (bench / "helper.py").write_text('"""Not runnable."""\n')
    res = tmp_path / "results"
    res.mkdir()
    (res / "thing.json").write_text('{"meta": {"command": "python -m benchmarks.micro.thing"}}')
    (res / "demo.json").write_text('{"meta": {"command": "python examples/demo.py"}}')
    text = index.render(tmp_path, res)
    row = ("| `benchmarks.micro.thing` | How fast is a thing? | "
           "`python -m benchmarks.micro.thing [--quick]` | [`thing.json`](results/thing.json) |")
    assert row in text
    assert "helper" not in text
    assert "| [`demo.json`](results/demo.json) | `python examples/demo.py` |" in text
