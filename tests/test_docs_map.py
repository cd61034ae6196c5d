"""The docs a newcomer reads first stay short, complete and self-contained (issue 33 item 5).

- ``docs/architecture.md`` is at most :data:`MAX_ARCHITECTURE_LINES` lines, and its module
  map names every module of ``kvcentric/``, ``router/`` and ``kernels/`` and every
  benchmarks group, and nothing that does not exist.
- No doc points outside the repository: no ``../shared``, and every relative link of
  README.md, benchmarks/README.md and docs/*.md resolves to a file of the repository.
- Every section reference (the section sign followed by a heading, optionally after a
  ``docs/FILE.md``) in the docs, the code, the benchmarks and the tests names a heading of
  that document; none uses the old numbered sections.
- Every test the docs cite (``tests/....py`` or ``test_....py``, with ``::name``) exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ARCH = DOCS / "architecture.md"
MAX_ARCHITECTURE_LINES = 250
SECTION = "\u00a7"  # the section sign, spelt out so this file cites no section itself
MARKDOWN = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]
CODE_DIRS = ("kvcentric", "router", "kernels", "benchmarks", "tests")
LINKED = ("kvcentric/kernels", "kvcentric/router")  # symlinks to the top-level packages


def python_files() -> list[Path]:
    out = []
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if "__pycache__" not in rel and not rel.startswith(LINKED) \
                    and "/results/" not in rel:
                out.append(p)
    return out


def headings(doc: Path) -> list[str]:
    """A document's section names: its headings less a trailing `` (`path`)``."""
    names = []
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            name = line.lstrip("#").strip()
            names.append(re.sub(r"\s+\(`[^)]*`\)$", "", name))
    return names


def section_refs(path: Path) -> list[tuple[int, str | None, str]]:
    """(line, document named or None, the text after the section sign) of every reference."""
    text = path.read_text()
    out = []
    for m in re.finditer(SECTION, text):
        before = text[max(0, m.start() - 80):m.start()]
        named = re.search(r"([\w-]+)\.md\)?\s*$", before)
        after = " ".join(text[m.end():m.end() + 120].split())
        out.append((text.count("\n", 0, m.start()) + 1, named.group(1) if named else None,
                    after))
    return out


def test_architecture_is_a_short_map() -> None:
    n = len(ARCH.read_text().splitlines())
    assert n <= MAX_ARCHITECTURE_LINES, f"docs/architecture.md has {n} lines; move details " \
        "to docs/{connector,store,router,sglang}.md"


def test_module_map_names_every_module_and_nothing_else() -> None:
    text = ARCH.read_text()
    part = text[text.index("## Module map"):]
    listed = set(re.findall(r"^\| `([^`]+)` \|", part, re.M))
    expected = set()
    for p in python_files():
        rel = p.relative_to(ROOT).as_posix()
        top = rel.split("/")[0]
        if top in ("kvcentric", "router", "kernels"):
            expected.add(rel.removeprefix("kvcentric/"))
    groups = {f"benchmarks/{p.parent.name}/" for p in (ROOT / "benchmarks").glob("*/__init__.py")}
    expected |= groups
    # a package row ("pkg/") stands for its modules when the package's own docstring maps
    # each of them (``:mod:`.name```): the map still names every module, one level down
    for row in (m for m in listed if m.endswith("/") and (ROOT / "kvcentric" / m).is_dir()):
        pkg = ROOT / "kvcentric" / row
        doc = (pkg / "__init__.py").read_text()
        for p in pkg.glob("*.py"):
            if p.stem in ("__init__", "__main__") or f":mod:`.{p.stem}`" in doc:
                expected.discard(row + p.name)
    missing = sorted(expected - listed)
    stale = sorted(m for m in listed - expected
                   if not (m.endswith("/") and ((ROOT / m).is_dir()
                                                or (ROOT / "kvcentric" / m).is_dir())))
    assert not missing, f"modules missing from the map: {missing}"
    assert not stale, f"the map names what does not exist: {stale}"


def test_no_doc_points_outside_the_repository() -> None:
    for doc in MARKDOWN:
        text = doc.read_text()
        rel = doc.relative_to(ROOT).as_posix()
        assert "../shared" not in text, f"{rel} points at ../shared"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{rel} links outside the repository: {target}"
            assert resolved.exists(), f"{rel} links to a missing file: {target}"


def test_every_section_reference_names_a_heading() -> None:
    names = {p.stem: headings(p) for p in DOCS.glob("*.md")}
    problems = []
    for path in [*MARKDOWN, *python_files()]:
        rel = path.relative_to(ROOT).as_posix()
        in_docs = path.parent == DOCS
        for line, doc, after in section_refs(path):
            if re.match(r"\d", after):
                problems.append(f"{rel}:{line}: a numbered section ({after[:12]!r})")
                continue
            target = doc or (path.stem if in_docs else None)
            if target not in names:
                problems.append(f"{rel}:{line}: names no document of docs/ ({after[:30]!r})")
            elif not any(after.startswith(h) for h in names[target]):
                problems.append(f"{rel}:{line}: docs/{target}.md has no heading {after[:30]!r}")
    assert not problems, "\n".join(problems)


def cited_test_file(cited: str) -> Path | None:
    """The test file a doc cites: a path under the repository (``tests/store/x.py``), or
    a bare name (``test_x.py``, ``gpu/test_x.py``) found in exactly one place under tests/."""
    if cited.startswith("tests/"):
        return ROOT / cited if (ROOT / cited).is_file() else None
    found = [p for p in (ROOT / "tests").rglob(Path(cited).name)
             if p.as_posix().endswith("/" + cited)]
    return found[0] if len(found) == 1 else None


def test_every_test_the_docs_cite_exists() -> None:
    problems = []
    for doc in MARKDOWN:
        rel = doc.relative_to(ROOT).as_posix()
        for m in re.finditer(r"(?<![\w/])((?:tests/)?(?:\w+/)?test_\w+\.py)(?:::(\w+))?",
                             doc.read_text()):
            path = cited_test_file(m.group(1))
            if path is None:
                problems.append(f"{rel}: {m.group(0)}: no such test file")
            elif m.group(2) and not re.search(rf"^(async )?def {m.group(2)}\(",
                                              path.read_text(), re.M):
                problems.append(f"{rel}: {m.group(0)}: no such test")
    assert not problems, "\n".join(problems)


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(f"# X\n## Disk tier (`a/b.py`)\nsee store.md {SECTION}Disk tier, and "
                   f"{SECTION}4.5 and [a](a.md)\n{SECTION}Nowhere\n")
    assert headings(doc) == ["X", "Disk tier"]
    refs = section_refs(doc)
    assert [(r[0], r[1], r[2][:9]) for r in refs] == [
        (3, "store", "Disk tier"), (3, None, "4.5 and ["), (4, "a", "Nowhere")]
