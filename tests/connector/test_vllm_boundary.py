"""The vLLM boundary is typed: mypy checks the connector's hooks against the installed vLLM.

``KVCentricConnector``'s hooks are annotated with vLLM's own classes
(:mod:`kvcentric.connector.vllm.boundary`), and mypy follows the installed vLLM (it ships
``py.typed``), so a vLLM release that changes a hook's signature fails ``make lint``. Held
here in two ways: no hook parameter that vLLM types is ``Any`` on our side, and mypy, run on
a copy of the connector whose ``update_state_after_alloc`` takes another type than vLLM's
``KVCacheBlocks`` (what a changed vLLM signature looks like from our side), reports an
incompatible override, while the real connector checks clean in the same run.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcentric.connector.vllm import boundary
from kvcentric.connector.vllm.connector import KVCentricConnector

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = ROOT / "kvcentric" / "connector" / "vllm" / "connector.py"


def overridden_hooks() -> list[str]:
    return [name for name, fn in vars(KVCentricConnector).items()
            if not name.startswith("_") and callable(getattr(KVConnectorBase_V1, name, None))
            and not isinstance(fn, property)]


def test_hooks_are_typed_with_vllm_classes() -> None:
    hooks = overridden_hooks()
    assert {"update_state_after_alloc", "build_connector_meta", "start_load_kv",
            "save_kv_layer", "get_num_new_matched_tokens"} <= set(hooks)
    assert set(boundary.HOOKS) <= set(hooks) | {"request_finished"}
    for name in hooks:
        ours = inspect.signature(inspect.unwrap(getattr(KVCentricConnector, name)))
        theirs = inspect.signature(getattr(KVConnectorBase_V1, name))
        for param in ours.parameters.values():
            if param.kind is param.VAR_KEYWORD or param.name in ("self", "cls"):
                continue
            base = theirs.parameters[param.name].annotation
            if base is inspect.Parameter.empty or base == "Any" or base is object:
                continue
            assert param.annotation != "Any", f"{name}({param.name}) is Any; vLLM types it"


def test_mypy_reports_a_hook_that_no_longer_matches_vllm(tmp_path: Path) -> None:
    source = CONNECTOR.read_text()
    changed = source.replace("blocks: KVCacheBlocks,", "blocks: list[int],")
    assert changed != source, "update_state_after_alloc's blocks parameter was renamed"
    copy = tmp_path / "connector_changed.py"
    copy.write_text(changed)
    # vLLM's modules are followed (their errors silenced), every other third-party
    # package is skipped (its types read as Any): the hooks' types are vLLM's own, and a
    # fresh clone's first run takes seconds where following torch and transformers too
    # took minutes (`make lint` still checks the whole tree against all of them)
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\npython_version = 3.11\nignore_missing_imports = True\n"
                      "follow_imports = skip\n"
                      "[mypy-vllm.*,kvcentric.*]\nfollow_imports = silent\n")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-error-summary",
         "--show-error-codes", "--cache-dir", str(ROOT / ".mypy_cache" / "vllm-boundary"),
         str(copy), str(CONNECTOR)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    errors = [line for line in lines if ": error:" in line]
    assert any(line.startswith(str(copy)) and '"update_state_after_alloc"' in line
               and "KVCacheBlocks" in line and "[override]" in line
               for line in errors), run.stdout + run.stderr
    assert all(line.startswith(str(copy)) for line in errors), run.stdout
