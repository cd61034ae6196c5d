"""Engine versions kvcentric is tested with, and the start-up check of the one installed.

Called once when a connector starts (docs/architecture.md §7). A version that lacks an API
the connector needs is a ``RuntimeError`` naming the API, so an incompatible engine fails
at start instead of silently never loading (e.g. a vLLM whose connector base class has no
``get_block_ids_with_load_errors`` would serve wrong tokens after a failed load). A
version that has every API but was not tested logs a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("kvcentric.compat")

TESTED_VLLM = ("0.32.0",)
TESTED_SGLANG = ("0.5.23",)


def check_engine(engine: str, version: str, tested: Iterable[str],
                 missing: Iterable[str]) -> None:
    """Raise ``RuntimeError`` when ``missing`` names an API the installed ``engine``
    ``version`` lacks; log a warning when ``version`` is not among ``tested``."""
    tested = tuple(tested)
    gone = sorted(missing)
    if gone:
        raise RuntimeError(f"{engine} {version} lacks {', '.join(gone)}, which kvcentric "
                           f"needs; use a tested version ({', '.join(tested)})")
    if version.split("+", 1)[0] not in tested:
        log.warning("kvcentric: %s %s is untested (tested: %s); report problems with the "
                    "version", engine, version, ", ".join(tested))


def missing_attrs(obj: object, names: Iterable[str], where: str) -> list[str]:
    """``where.name`` for every name ``obj`` lacks (the API probe of a third-party
    class; our own optional capabilities are declared, never probed)."""
    return [f"{where}.{n}" for n in names if not hasattr(obj, n)]
