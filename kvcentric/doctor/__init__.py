"""``kvcentric doctor``: the misconfigurations users hit, each found and explained.

    kvcentric doctor [--store JSON] [--router-config FILE] [--url ENGINE_URL] [--json]

One function per diagnosis, each returning :class:`Finding` s (``ok``, ``warn``, ``fail``
or ``skip``, a message and how to fix it); :func:`run` picks the ones the inputs allow and
the CLI exits 1 when any failed. Checks only read: the store is opened without starting a
coordinator or prefaulting its arena, and Mooncake is asked over its master's HTTP
endpoints (no client joins the pool). The one exception is the layout probe
(:mod:`kvcentric.doctor.layout`), which sends the engine at ``--url`` one completion.

Modules: :mod:`~kvcentric.doctor.findings` (the result type and report),
:mod:`~kvcentric.doctor.engines` (engines installed here or at a URL, the vLLM plugin),
:mod:`~kvcentric.doctor.stores` (local coordinator and tmpfs, Mooncake master and
transport), :mod:`~kvcentric.doctor.layout` (which keys an engine really writes),
:mod:`~kvcentric.doctor.router_checks` (the router's config against its engines),
:mod:`~kvcentric.doctor.diagnose` (the whole run).
"""

from kvcentric.doctor.diagnose import DoctorInputs, run
from kvcentric.doctor.findings import FAIL, OK, SKIP, WARN, Finding, render

__all__ = ["FAIL", "OK", "SKIP", "WARN", "DoctorInputs", "Finding", "render", "run"]
