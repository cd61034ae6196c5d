"""What every diagnosis returns: a :class:`Finding` and its status, and the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(frozen=True)
class Finding:
    """One diagnosis: ``check`` names it, ``status`` is ok/warn/fail/skip."""

    check: str
    status: str
    message: str
    fix: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["details"] = dict(self.details)
        return out


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals, for messages."""
    return f"{n / (1 << 30):.2f} GiB"


def render(findings: list[Finding]) -> str:
    """The findings as the CLI prints them, with a fix under each warning and failure."""
    marks = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL", SKIP: "skip"}
    lines = []
    for f in findings:
        lines.append(f"[{marks[f.status]}] {f.check}: {f.message}")
        if f.fix and f.status in (WARN, FAIL):
            lines.append(f"       fix: {f.fix}")
    bad = sum(f.status == FAIL for f in findings)
    lines.append(f"{bad} problem(s), {sum(f.status == WARN for f in findings)} warning(s)")
    return "\n".join(lines)
