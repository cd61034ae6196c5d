"""What does the router's /dashboard show (a headless Chromium screenshot)?

Screenshot of a running router's ``/dashboard`` with headless Chromium.

    python -m benchmarks.serving.dashboard_screenshot --url http://127.0.0.1:8000 \\
        [--out benchmarks/results/dashboard.json]

Refreshes the committed ``benchmarks/results/dashboard.json`` (the command and machine)
and its figure ``dashboard_page.png`` (take it after sending some traffic through the
router, or the page shows zeros). ``tests/e2e/test_router_e2e.py`` writes the same pair from
its populated cluster when ``KVC_DASHBOARD_SCREENSHOT`` names the JSON path. The Chromium
helpers here are shared with the dashboard tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib import results_writer as rw

# virtual time: timers run at once, but the page's fetches of /metrics are real; 5 s of
# it covers the first render and two refreshes
BUDGET_MS = 5000
TIMEOUT_S = 60
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def chromium_path() -> str | None:
    """The Chromium binary on PATH (Debian's ``chromium``, else ``chromium-browser``)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, *flags: str) -> bytes:
    """Run headless Chromium on ``url`` with ``flags``; its stdout. A throwaway profile
    and HOME (Chromium writes both; the caller's may be read-only or shared)."""
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="kvc-chromium-") as tmp:
        # --no-sandbox: the sandbox needs user namespaces, absent in containers and as root
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp}",
               f"--virtual-time-budget={BUDGET_MS}", *flags, url]
        out = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S, check=True,
                             env={**os.environ, "HOME": tmp})
    return out.stdout


def dump_dom(url: str) -> str:
    """The page's DOM once its scripts ran (``--dump-dom``)."""
    return chromium(url, "--dump-dom").decode()


def screenshot(url: str, out: Path, size: str = "1280,900") -> Path:
    """Write a PNG of the rendered page to ``out``; raises if Chromium wrote none."""
    out.parent.mkdir(parents=True, exist_ok=True)
    chromium(url, f"--window-size={size}", f"--screenshot={out.resolve()}")
    if not out.is_file() or not out.read_bytes().startswith(PNG_MAGIC):
        raise RuntimeError(f"chromium wrote no PNG to {out}")
    return out


def record(url: str, out: Path, size: str = "1280,900",
           command: str | None = None) -> list[Path]:
    """Write ``out`` (JSON: the page's URL, the command and machine) and its figure
    ``<stem>_page.png``, the screenshot of ``url``'s ``/dashboard``."""
    page = url.rstrip("/") + "/dashboard"
    return rw.write(out, {"url": page, "window_size": size},
                    figures=[rw.Figure("page", "the router's /dashboard, rendered by "
                                       "headless Chromium", lambda p: screenshot(page, p, size))],
                    command=command)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="the router's base URL")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dashboard.json"))
    ap.add_argument("--window-size", default="1280,900")
    args = ap.parse_args(argv)
    record(args.url, args.out, args.window_size, rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
