"""The whole doctor run: which diagnoses the inputs allow, in a fixed order."""

from __future__ import annotations

from dataclasses import dataclass

from kvcentric.config import StoreConfig
from kvcentric.doctor import layout, router_checks
from kvcentric.doctor.engines import (
    check_engine_url_version,
    check_plugin,
    probe_sglang,
    probe_vllm,
)
from kvcentric.doctor.findings import SKIP, WARN, Finding
from kvcentric.doctor.stores import store_findings


@dataclass(frozen=True)
class DoctorInputs:
    """What the doctor checks. ``engines``: False leaves out the installed-engine and
    plugin checks (each imports vLLM or SGLang: most of a run's time), e.g. on a router
    or store host that runs no engine, or to recheck a store or router config."""

    store: StoreConfig | None = None
    router_config: str | None = None
    url: str | None = None
    engines: bool = True


def run(inputs: DoctorInputs) -> list[Finding]:
    """Every check the inputs allow, in a fixed order."""
    out: list[Finding] = []
    if inputs.engines:
        out += engine_findings()
    router = None
    if inputs.router_config:
        router, finding = router_checks.load_router(inputs.router_config)
        out.append(finding)
        if router is not None:
            out += router_checks.check_router_files(router)
    store = inputs.store or (router.store if router is not None else None)
    if store is not None:
        out += store_findings(store)
    probe = None
    if inputs.url:
        out.append(check_engine_url_version(inputs.url))
        roles = {i.url: i.role for i in router.instances} if router is not None else {}
        if roles.get(inputs.url.rstrip("/")) == "decode":
            out.append(Finding("layout-signature", SKIP, f"{inputs.url} is a decode instance "
                               "(kv_consumer: it never saves); probe a prefill one"))
        elif store is not None:
            finding, probe = layout.check_layout(store, inputs.url)
            out.append(finding)
    if router is not None:
        out += router_checks.check_router(router, probe)
    return out


def engine_findings() -> list[Finding]:
    """The installed engines (each probed in a child process) and the vLLM plugin."""
    # each engine's import, in a child process of its own, overlaps the other's and the
    # plugin check's import of vLLM here: on more than one core the doctor waits for the
    # slowest import, not for the sum
    probes = [probe_vllm(), probe_sglang()]
    plugin = check_plugin()
    out = [p.finding() for p in probes]
    if all(f.status == SKIP for f in out):
        out.append(Finding("engines", WARN, "neither vLLM nor SGLang is installed here",
                           "run the doctor where the engine runs"))
    out.append(plugin)
    return out
