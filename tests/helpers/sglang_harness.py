"""Run ``tests/helpers/sglang_checks.py`` in one long-lived subprocess.

Importing SGLang sets environment variables (Triton/Inductor cache dirs), patches
``transformers`` and adds warning filters, process-wide. The test session must not
inherit that (it builds models with transformers and starts vLLM servers), so the
SGLang tests drive the backend from this subprocess, started once per test module.

Protocol: one JSON request per stdin line, ``{"check": NAME, "kwargs": {...}}``; one
reply per stdout line, prefixed ``@@kvc ``: ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": TRACEBACK}``.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

PREFIX = "@@kvc "
ROOT = Path(__file__).resolve().parents[2]


class Harness:
    """Client side: starts the subprocess; :meth:`call` runs one check there."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, bufsize=1)
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, out: IO[str] | None) -> None:
        assert out is not None
        for line in out:
            if line.startswith(PREFIX):
                self._replies.put(line[len(PREFIX):])
        self._replies.put(None)  # the subprocess exited

    def call(self, check: str, timeout: float = 180.0, **kwargs: Any) -> Any:
        """Run ``sglang_checks.<check>(**kwargs)``; its failure fails the caller."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"check": check, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        try:
            raw = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{check}: no answer in {timeout} s\n{self.log_tail()}") from None
        if raw is None:
            raise AssertionError(f"{check}: the SGLang subprocess died\n{self.log_tail()}")
        reply = json.loads(raw)
        if not reply["ok"]:
            # the log holds the backend's own warnings (a store call that failed, and why)
            raise AssertionError(f"{check} failed in the SGLang subprocess:\n{reply['error']}"
                                 f"\n{self.log_tail()}")
        return reply["result"]

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import sglang_checks

    for line in sys.stdin:
        req = json.loads(line)
        try:
            result = getattr(sglang_checks, req["check"])(**req["kwargs"])
            reply = {"ok": True, "result": result}
        except BaseException:  # report everything, keep serving the next check
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.write(PREFIX + json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
