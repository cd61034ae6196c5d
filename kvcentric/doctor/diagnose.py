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

# the engines the doctor knows how to inspect, by their ``--engine`` names
ENGINES = ("vllm", "sglang")
_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


@dataclass(frozen=True)
class DoctorInputs:
    """What the doctor checks. ``engines``: the installed engines to inspect, a subset of
    :data:`ENGINES` (each inspection imports that engine in a child process: most of a
    run's time), the vLLM plugin check with ``vllm``; ``()`` leaves them all out, e.g. on a
    router or store host that runs no engine, or to recheck a store or router config.
    Raises ``ValueError`` for an engine it does not know."""

    store: StoreConfig | None = None
    router_config: str | None = None
    url: str | None = None
    engines: tuple[str, ...] = ENGINES

    def __post_init__(self) -> None:
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown:
            raise ValueError(f"unknown engine(s) {unknown}: choose from {list(ENGINES)}")


def run(inputs: DoctorInputs) -> list[Finding]:
    """Every check the inputs allow, in a fixed order."""
    out: list[Finding] = []
    if inputs.engines:
        out += engine_findings(inputs.engines)
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


def engine_findings(engines: tuple[str, ...] = ENGINES) -> list[Finding]:
    """The installed ``engines`` (each probed in a child process) and, with ``vllm``, the
    vLLM plugin."""
    # each engine's import, in a child process of its own, overlaps the other's and the
    # plugin check's import of vLLM here: on more than one core the doctor waits for the
    # slowest import, not for the sum
    wanted = tuple(dict.fromkeys(engines))  # each once, in the order given
    probers = {"vllm": probe_vllm, "sglang": probe_sglang}
    probes = [probers[e]() for e in wanted]
    plugin = check_plugin() if "vllm" in wanted else None
    out = [p.finding() for p in probes]
    if out and all(f.status == SKIP for f in out):
        names = [_NAMES[e] for e in wanted]
        message = (f"neither {names[0]} nor {names[1]} is installed here" if len(names) == 2
                   else f"{names[0]} is not installed here")
        out.append(Finding("engines", WARN, message, "run the doctor where the engine runs"))
    if plugin is not None:
        out.append(plugin)
    return out
