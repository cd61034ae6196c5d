"""Every command the README, docs/*.md, the examples' README and the configs' comments show
is checked against the real argument parser of the program it runs (issue 49): a flag the
program does not have, a subcommand it does not know or a value its type or choices refuse
fails here, so the docs cannot drift from the code.

Commands are ``kvcentric ...``, ``kvcentric-router ...``, ``python -m kvcentric...`` and
``python -m benchmarks...``, found in inline code spans (at their start) and in fenced
blocks (at a line's start, after ``$``/environment assignments; ``\\`` continues a line).
The parser is the program's own object, captured where its ``main`` (or ``python -m``'s
module run) calls ``parse_args``. Documentation conventions are read as a user would:
``[...]`` optional parts are checked as if given, ``{a,b}`` and ``a|b`` alternatives each,
``serve/stop`` a list of subcommands, and placeholders (``MODEL``, ``N``, ``...``,
``$VAR``) stand for any value. A command that shows flags must show the required ones
(a bare ``...`` stands for the rest); one named in passing without flags
(``kvcentric-router profile`` measures ...) need not.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
           "examples/multi-node-mooncake/README.md",
           *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))]
_START = re.compile(r"(?:kvcentric-router|kvcentric|python3? -m (?:kvcentric|benchmarks)"
                    r"(?:\.[A-Za-z0-9_]+)+)(?=\s|$)")
_LEAD = re.compile(r"^(?:\$\s+|(?:[A-Z_][A-Z0-9_]*=\S*\s+)+|exec\s+|\.venv/bin/)*")
_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|.*\.\.\..*|<[^>]*>|.*\$.*|[a-z]\b")


def _spans(text: str, yaml: bool) -> Iterator[tuple[int, str]]:
    """(line, text) of each place a command may start: a fenced block's lines (joined at
    ``\\``), an inline code span, or (YAML) a comment's code span."""
    if yaml:  # comments only
        text = "\n".join(line.split("#", 1)[1] if "#" in line else "" for line in
                         text.splitlines())
    lines = text.splitlines()
    prose: list[str] = []
    fence = False
    buf, start = "", 0
    for no, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            prose.append("")
            continue
        if fence:
            buf, start = (buf + " " + line.strip(), start) if buf else (line.strip(), no)
            if buf.endswith("\\"):
                buf = buf[:-1]
                continue
            yield start, buf
            buf = ""
            prose.append("")
        else:
            prose.append(line)
    joined = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", joined):
        yield joined.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())


def commands() -> list[tuple[str, str]]:
    """(``file:line``, command) of every command the sources show."""
    found = []
    for rel in SOURCES:
        path = ROOT / rel
        for line, span in _spans(path.read_text(), rel.endswith(".yaml")):
            span = _LEAD.sub("", span.strip())
            if not _START.match(span):
                continue
            # one command: up to a shell separator or a comment
            cmd = re.split(r"\s(?:&&|\|\||\||;|#|>|2>)\s|\s#", span + " ")[0].strip()
            found.append((f"{rel}:{line}", cmd))
    return found


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextmanager
def _capturing() -> Iterator[None]:
    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab):
        yield


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def parser_of(program: str) -> argparse.ArgumentParser:
    """The real parser of ``program`` (``kvcentric``, ``kvcentric-router`` or a module
    run with ``python -m``), as its entry point builds it."""
    if program not in _PARSERS:
        argv = sys.argv
        try:
            with _capturing():
                sys.argv = [program]
                if program == "kvcentric":
                    from kvcentric.cli import main
                    main([])
                elif program == "kvcentric-router":
                    from kvcentric.router.cli import main as router_main
                    router_main([])
                else:
                    with warnings.catch_warnings():
                        # a module the suite imported already runs again as __main__,
                        # as `python -m` would run it: runpy's warning says only that
                        warnings.simplefilter("ignore", RuntimeWarning)
                        runpy.run_module(program, run_name="__main__", alter_sys=True)
        except _Captured as got:
            _PARSERS[program] = got.parser
        finally:
            sys.argv = argv
        assert program in _PARSERS, f"{program} never parsed its arguments"
    return _PARSERS[program]


def _expand(tokens: list[str]) -> list[list[str]]:
    """The documented alternatives as separate argument lists: ``{a,b}`` gives one per
    choice, as does ``a|b``; ``[...]`` brackets are dropped (checked as if given)."""
    out: list[list[str]] = [[]]
    for tok in tokens:
        if re.fullmatch(r"\{[\w,.-]+\}", tok):
            out = [o + [alt] for o in out for alt in tok[1:-1].split(",")]
            continue
        if tok not in ("[", "]") and not tok.startswith(("{", "'", '"')):
            tok = tok.strip("[]")
        if "|" in tok and not tok.startswith("-"):
            out = [o + [alt] for o in out for alt in tok.split("|")]
        elif tok:
            out = [o + [tok] for o in out]
    return out


def _check_value(action: argparse.Action, value: str, where: str) -> None:
    if _PLACEHOLDER.fullmatch(value):
        return
    try:
        converted = action.type(value) if callable(action.type) else value  # type: ignore
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        pytest.fail(f"{where}: {'/'.join(action.option_strings) or action.dest} {value!r}: "
                    f"{exc}")
    if action.choices is not None and converted not in action.choices:
        pytest.fail(f"{where}: {value!r} is not one of {sorted(map(str, action.choices))} "
                    f"for {'/'.join(action.option_strings) or action.dest}")


def _required(parser: argparse.ArgumentParser, seen: set[str], rest: bool,
              where: str) -> None:
    """A command that shows flags of ``parser`` shows all its required ones (unless a bare
    ``...`` says "and the rest")."""
    if not seen or rest:
        return
    for action in parser._actions:
        if action.required and action.option_strings and not seen & set(
                action.option_strings):
            pytest.fail(f"{where}: {parser.prog} needs {'/'.join(action.option_strings)}")


def check(parser: argparse.ArgumentParser, args: list[str], where: str) -> None:
    """Walk ``args`` through ``parser``'s own actions: subcommands descend, every flag must
    be one the (sub)parser defines, its value must pass the flag's type and choices, and a
    command showing flags shows the required ones."""
    seen: set[str] = set()
    rest = False  # a bare "..." (not a flag's value): "and the rest"
    i = 0
    while i < len(args):
        tok = args[i]
        if tok.startswith("-") and tok not in ("-", "--") and not re.fullmatch(r"-\d.*", tok):
            flag, eq, inline = tok.partition("=")
            action = parser._option_string_actions.get(flag)
            if action is None:
                known = sorted(s for s in parser._option_string_actions if s.startswith("--"))
                pytest.fail(f"{where}: {parser.prog} has no flag {flag} (it has {known})")
            seen.add(flag)
            nargs = action.nargs
            if nargs == 0 or isinstance(action, (argparse._StoreConstAction,
                                                 argparse._HelpAction)):
                i += 1
                continue
            if eq:
                _check_value(action, inline, where)
                i += 1
                continue
            many = nargs in ("*", "+") or isinstance(nargs, int) and nargs > 1
            take = 1
            while i + take < len(args) and not args[i + take].startswith("-") and (
                    many or take == 1):
                if args[i + take] != "...":
                    _check_value(action, args[i + take], where)
                take += 1
                if not many:
                    break
            i += take
            continue
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and "/" in tok:  # a list of subcommands (``serve/stop/mooncake-*``)
            for name in tok.split("/"):
                if not any(c == name or name.endswith("*") and c.startswith(name[:-1])
                           for c in subs[0].choices):
                    pytest.fail(f"{where}: {parser.prog} has no subcommand {name!r}")
            return
        if subs and tok in subs[0].choices:
            _required(parser, seen, rest, where)
            parser, seen = subs[0].choices[tok], set()
        elif subs and not _PLACEHOLDER.fullmatch(tok) and tok != "...":
            pytest.fail(f"{where}: {parser.prog} has no subcommand {tok!r} (it has "
                        f"{sorted(subs[0].choices)})")
        rest = rest or tok == "..."
        i += 1
    _required(parser, seen, rest, where)


DOC_COMMANDS = commands()


def test_the_docs_show_commands_of_every_program() -> None:
    """The extraction finds what the docs are known to show (a broken extractor would
    pass everything)."""
    shown = {cmd.split()[0] if not cmd.startswith("python") else cmd.split()[2]
             for _, cmd in DOC_COMMANDS}
    assert {"kvcentric", "kvcentric-router", "kvcentric.testing.models",
            "benchmarks.serving.loadgen"} <= shown, sorted(shown)
    assert any("--model tiny --out profile.json" in cmd for where, cmd in DOC_COMMANDS
               if where.startswith("configs/router.yaml"))


@pytest.mark.parametrize("where, cmd", DOC_COMMANDS, ids=[w for w, _ in DOC_COMMANDS])
def test_a_documented_command_parses(where: str, cmd: str) -> None:
    tokens = shlex.split(cmd)
    if tokens[0].startswith("python"):
        program, args = tokens[2], tokens[3:]
    else:
        program, args = tokens[0], tokens[1:]
    parser = parser_of(program)
    for variant in _expand(args):
        check(parser, variant, f"{where}: {cmd}")
        if any(t.startswith("--") for t in variant) and not any(
                _PLACEHOLDER.fullmatch(t) or t == "..." for t in variant):
            # written out in full: the program's own parse_args must take it as it stands
            try:
                parser.parse_args(variant)
            except SystemExit:
                pytest.fail(f"{where}: {parser.prog} refuses {variant} (see its message)")


def test_a_wrong_flag_fails() -> None:
    """The checker itself: a misspelt flag, an unknown subcommand and a refused choice."""
    router = parser_of("kvcentric-router")
    for bad in (["profile", "--urll", "http://x"], ["serv"], ["serve", "--log-level", "loud"],
                ["profile", "--repeats", "two"],
                ["profile", "--url", "...", "--out", "profile.json"]):  # no --model
        with pytest.raises(pytest.fail.Exception):
            check(router, bad, "self-test")
    check(router, ["profile", "--url", "http://127.0.0.1:8100", "--model", "tiny", "--out",
                   "p.json", "--hits", "0,0.5"], "self-test")


def _port_uses() -> dict[int, set[str]]:
    """Every port the README and configs/ give an address, with what it is for: a ZMQ
    endpoint's (KV events or their replay, by the key in front of it) or HTTP."""
    uses: dict[int, set[str]] = {}
    for rel in ["README.md", *sorted(str(p.relative_to(ROOT))
                                     for p in (ROOT / "configs").glob("*.yaml"))]:
        text = (ROOT / rel).read_text()
        for m in re.finditer(r"(tcp|https?)://[A-Za-z0-9.*-]+:(\d+)", text):
            before = text[max(0, m.start() - 24):m.start()]
            use = ("http" if m.group(1).startswith("http") else
                   "kv events replay" if "replay" in before else "kv events")
            uses.setdefault(int(m.group(2)), set()).add(f"{use} ({rel})")
    return uses


def test_no_port_has_two_uses_across_the_readme_and_configs() -> None:
    """An example that gives one port two jobs (the README's replay endpoint on the port
    configs/router.yaml gives instance 2's events) fails when both run."""
    clashes = {port: sorted(uses) for port, uses in _port_uses().items()
               if len({u.split(" (")[0] for u in uses}) > 1}
    assert not clashes, clashes
    assert {"kv events replay (README.md)"} <= _port_uses()[5701]


def test_the_multi_node_example_router_takes_the_engines_block_size() -> None:
    """examples/multi-node-mooncake/router.yaml.in, filled as 4-router.sh fills it, leaves
    the block size to the engines (a pinned 256 never matched their 128-token blocks, and
    run-one-machine.sh now asserts store hits through the router)."""
    import yaml

    from kvcentric.router.config import RouterConfig

    text = (ROOT / "examples/multi-node-mooncake/router.yaml.in").read_text()
    for name, value in (("MODEL", ".models/tiny"), ("ROUTER_HOST", "127.0.0.1"),
                        ("ROUTER_PORT", "8000"), ("ENGINE1", "http://127.0.0.1:8100"),
                        ("ENGINE2", "http://127.0.0.1:8101"), ("MASTER", "127.0.0.1:50051"),
                        ("METADATA", "http://127.0.0.1:8080/metadata")):
        text = text.replace(f"@{name}@", value)
    assert not re.search(r"@[A-Z0-9_]+@", text)
    cfg = RouterConfig.from_dict(yaml.safe_load(text))
    assert cfg.keys.block_size is None and cfg.store is not None
    script = (ROOT / "examples/multi-node-mooncake/run-one-machine.sh").read_text()
    assert "x-kvc-hit-tokens" in script and 'tier="store_dram"' in script
