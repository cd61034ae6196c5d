"""Diagnoses of the engines installed here (or at a URL) and of the vLLM plugin."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvcentric.compat import TESTED_SGLANG, TESTED_VLLM
from kvcentric.config import EngineEnv
from kvcentric.doctor.findings import FAIL, OK, SKIP, WARN, Finding

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_TARGET = "kvcentric.connector.vllm.plugin:register"

_PROBE = """
import importlib, json, sys
from pathlib import Path
module, probe = sys.argv[1], sys.argv[2]
try:
    mod = importlib.import_module(module)
except ImportError:
    print(json.dumps({"installed": False})); sys.exit(0)
out = {"installed": True, "version": str(getattr(mod, "__version__", "unknown")),
       "path": str(Path(getattr(mod, "__file__", "") or "?").parent), "error": None}
try:
    pmod, func = probe.split(":")
    getattr(importlib.import_module(pmod), func)()
except RuntimeError as exc:
    out["error"], out["missing_hook"] = str(exc), True
except Exception as exc:
    out["error"], out["missing_hook"] = f"{type(exc).__name__}: {exc}", False
print(json.dumps(out))
"""


def _engine_version(check: str, name: str, module: str, tested: tuple[str, ...],
                    probe: str) -> Finding:
    """Import engine ``module`` and run kvcentric's start-up API check ``probe``
    (``module:function``) in a child process (importing an engine changes process-wide
    state: SGLang's imports do), then compare the version with ``tested``."""
    import json
    import subprocess
    import sys

    try:
        run = subprocess.run([sys.executable, "-c", _PROBE, module, probe],
                             capture_output=True, text=True, timeout=300)
        got = json.loads(run.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return Finding(check, FAIL, f"could not inspect {name}: {exc}",
                       f"run python -c 'import {module}' to see why")
    if not got["installed"]:
        return Finding(check, SKIP, f"{name} is not installed here")
    version, where = got["version"], got["path"]
    details = {"version": version, "path": where, "tested": list(tested)}
    fix = f"install {name} {' or '.join(tested)} (the versions kvcentric is tested with)"
    if got["error"] and got["missing_hook"]:  # a hook kvcentric needs is missing
        return Finding(check, FAIL, got["error"], fix, details)
    if got["error"]:  # an engine too old or broken to import at all
        return Finding(check, FAIL, f"{name} {version} at {where} lacks the API kvcentric "
                       f"plugs into ({got['error']})", fix, details)
    if version.split("+", 1)[0] not in tested:
        return Finding(check, WARN, f"{name} {version} has every hook kvcentric needs but "
                       f"is untested (tested: {', '.join(tested)})", fix, details)
    return Finding(check, OK, f"{name} {version} (tested)", details=details)


def check_vllm_version() -> Finding:
    return _engine_version("vllm-version", "vLLM", "vllm", TESTED_VLLM,
                           "kvcentric.connector.vllm.connector:check_vllm")


def check_sglang_version() -> Finding:
    return _engine_version("sglang-version", "SGLang", "sglang", TESTED_SGLANG,
                           "kvcentric.connector.sglang.storage:check_sglang")


def check_engine_url_version(url: str) -> Finding:
    """The vLLM version the engine at ``url`` reports (``GET /version``)."""
    try:
        r = httpx.get(url.rstrip("/") + "/version", timeout=5)
        r.raise_for_status()
        version = str(r.json()["version"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Finding("engine-url-version", FAIL, f"engine at {url} does not answer "
                       f"/version: {exc}", "check --url (the engine's http://host:port)")
    details = {"url": url, "version": version}
    if version.split("+", 1)[0] not in TESTED_VLLM:
        return Finding("engine-url-version", WARN, f"engine at {url} runs vLLM {version}, "
                       f"untested (tested: {', '.join(TESTED_VLLM)})",
                       f"run vLLM {' or '.join(TESTED_VLLM)}", details)
    return Finding("engine-url-version", OK, f"engine at {url} runs vLLM {version}",
                   details=details)


def check_plugin() -> Finding:
    """The ``vllm.general_plugins`` entry point that registers ``KVCentricConnector``."""
    from importlib.metadata import entry_points

    import kvcentric

    fix = ("pip install kvcentric into the engine's environment (or give vLLM "
           "\"kv_connector_module_path\": \"kvcentric.connector.vllm\")")
    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == "kvcentric"]
    if not eps:
        return Finding("connector-plugin", FAIL, f"no '{PLUGIN_GROUP}' entry point named "
                       f"kvcentric: kvcentric imports from {Path(kvcentric.__file__).parent} "
                       "but is not installed there, so vLLM never registers "
                       "KVCentricConnector", fix)
    allowed = EngineEnv.from_environ().vllm_plugins
    if allowed is not None and "kvcentric" not in allowed.split(","):
        return Finding("connector-plugin", FAIL, f"VLLM_PLUGINS={allowed!r} leaves the "
                       "kvcentric plugin out", "add kvcentric to VLLM_PLUGINS or unset it")
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return Finding("connector-plugin", SKIP, "vLLM is not installed here")
    if eps[0].value != PLUGIN_TARGET:
        return Finding("connector-plugin", FAIL, f"the kvcentric entry point names "
                       f"{eps[0].value}, not {PLUGIN_TARGET} (a stale install)", fix)
    eps[0].load()()
    if "KVCentricConnector" not in KVConnectorFactory._registry:
        return Finding("connector-plugin", FAIL, "the plugin ran but vLLM's connector "
                       "factory does not know KVCentricConnector", fix)
    return Finding("connector-plugin", OK, "vLLM plugin registers KVCentricConnector",
                   details={"entry_point": eps[0].value})
