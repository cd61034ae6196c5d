"""Diagnoses of the engines installed here (or at a URL) and of the vLLM plugin."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcentric.compat import (
    API_CHECKED_VLLM,
    CHECKED,
    MIN_VLLM,
    TESTED,
    TESTED_SGLANG,
    TESTED_VLLM,
    TOO_OLD,
    support,
    supported_range,
)
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


@dataclass(frozen=True)
class _Policy:
    """An engine's support policy (:func:`kvcentric.compat.support`) and what to advise."""

    name: str
    tested: tuple[str, ...]
    api_checked: tuple[str, ...] = ()
    minimum: str | None = None
    patches: bool = True

    def level(self, version: str) -> str:
        return support(version, self.tested, self.api_checked, self.minimum, self.patches)

    @property
    def advice(self) -> str:
        tested = ", ".join(self.tested)
        if self.patches:
            return (f"use {self.name} "
                    f"{supported_range(self.tested, self.api_checked, self.minimum)} "
                    f"(run-tested: {tested})")
        return f"use {self.name} {' or '.join(self.tested)} (the versions kvcentric is tested with)"


VLLM = _Policy("vLLM", TESTED_VLLM, API_CHECKED_VLLM, MIN_VLLM)
SGLANG = _Policy("SGLang", TESTED_SGLANG, patches=False)


def version_finding(check: str, policy: _Policy, version: str, where: str,
                    details: dict[str, Any]) -> Finding:
    """The finding for an engine ``version`` that has every hook kvcentric needs, by the
    policy the connector's start-up gate applies."""
    level = policy.level(version)
    if level == TESTED:
        return Finding(check, OK, f"{where}{policy.name} {version} (tested)", details=details)
    if level == CHECKED:
        return Finding(check, OK, f"{where}{policy.name} {version} (supported: its minor's "
                       f"connector API checked, not run-tested; tested: "
                       f"{', '.join(policy.tested)})", details=details)
    return Finding(check, WARN, f"{where}{policy.name} {version} is {level} (tested: "
                   f"{', '.join(policy.tested)})", policy.advice, details)


class EngineProbe:
    """An engine's install, inspected in a child process started at construction (importing
    an engine changes process-wide state: SGLang's imports do): it imports ``module``
    and runs kvcentric's start-up API check ``probe`` (``module:function``). Several
    probes run at once; :meth:`finding` waits for this one and judges the version by
    ``policy``."""

    def __init__(self, check: str, policy: _Policy, module: str, probe: str) -> None:
        import subprocess
        import sys

        self.check, self.policy, self.module = check, policy, module
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, module, probe],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, text=True)

    def finding(self, timeout_s: float = 300.0) -> Finding:
        import json
        import subprocess

        name, policy = self.policy.name, self.policy
        try:
            try:
                stdout, _ = self._proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.communicate()
                raise
            got = json.loads(stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError) as exc:
            return Finding(self.check, FAIL, f"could not inspect {name}: {exc}",
                           f"run python -c 'import {self.module}' to see why")
        if not got["installed"]:
            return Finding(self.check, SKIP, f"{name} is not installed here")
        version, where = got["version"], got["path"]
        details = {"version": version, "path": where, "tested": list(policy.tested),
                   "support": policy.level(version)}
        if got["error"] and got["missing_hook"]:  # too old, or a hook kvcentric needs is missing
            return Finding(self.check, FAIL, got["error"], policy.advice, details)
        if got["error"]:  # an engine too old or broken to import at all
            return Finding(self.check, FAIL, f"{name} {version} at {where} lacks the API "
                           f"kvcentric plugs into ({got['error']})", policy.advice, details)
        return version_finding(self.check, policy, version, "", details)


def probe_vllm() -> EngineProbe:
    return EngineProbe("vllm-version", VLLM, "vllm",
                       "kvcentric.connector.vllm.boundary:check_vllm")


def probe_sglang() -> EngineProbe:
    return EngineProbe("sglang-version", SGLANG, "sglang",
                       "kvcentric.connector.sglang.storage:check_sglang")


def check_vllm_version() -> Finding:
    return probe_vllm().finding()


def check_sglang_version() -> Finding:
    return probe_sglang().finding()


def check_engine_url_version(url: str) -> Finding:
    """The vLLM version the engine at ``url`` reports (``GET /version``), by the policy
    the connector's start-up gate applies."""
    import httpx  # the router extra's; a plain install's doctor never asks an engine

    try:
        r = httpx.get(url.rstrip("/") + "/version", timeout=5)
        r.raise_for_status()
        version = str(r.json()["version"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Finding("engine-url-version", FAIL, f"engine at {url} does not answer "
                       f"/version: {exc}", "check --url (the engine's http://host:port)")
    details = {"url": url, "version": version, "support": VLLM.level(version)}
    if VLLM.level(version) == TOO_OLD:
        return Finding("engine-url-version", FAIL, f"engine at {url} runs vLLM {version}, "
                       f"older than {MIN_VLLM}", VLLM.advice, details)
    return version_finding("engine-url-version", VLLM, version, f"engine at {url} runs ",
                           details)


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
