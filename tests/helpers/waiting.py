"""Polling for a condition in tests: true as soon as it holds, false after ``timeout``."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred`` every ``interval`` s until it is truthy or ``timeout`` s pass; the
    last evaluation decides."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
