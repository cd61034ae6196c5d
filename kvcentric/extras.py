"""Optional dependencies: which extra installs each, and the one line a missing one gives.

A plain ``pip install kvcentric`` carries the store, its CLI and the doctor; the router,
Mooncake and the Triton kernels come with extras (``pyproject.toml``). Modules import an
optional dependency where they use it, so a command that never needs it never imports it;
one that does and finds it missing raises ``ModuleNotFoundError`` (or
:class:`MissingExtra`), which every entry point turns into one line naming the extra to
install and exit code 2 (:func:`run_cli`), never a traceback.

Contract: :data:`EXTRA_OF` maps the top-level module name of every optional dependency
kvcentric imports to the extra that installs it (``tests/test_install.py`` checks it
against the extras' requirements); a ``ModuleNotFoundError`` for any other module is a
bug and propagates.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# top-level module -> extra. transformers leaves jinja2 (chat templates) optional, so the
# router extra names it itself; starlette and pydantic come with fastapi, yarl with aiohttp.
EXTRA_OF = {
    "fastapi": "router", "starlette": "router", "pydantic": "router", "uvicorn": "router",
    "httpx": "router", "transformers": "router", "tokenizers": "router", "jinja2": "router",
    "zmq": "router", "aiohttp": "router", "yarl": "router",
    "mooncake": "mooncake",
    "triton": "kernels",
}

# what to type for each extra (mooncake: the CUDA wheel, or the non-CUDA one)
INSTALL = {
    "mooncake": "pip install 'kvcentric[mooncake]' (or 'kvcentric[mooncake-cpu]' without "
                "CUDA)",
}


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra``."""
    return INSTALL.get(extra, f"pip install 'kvcentric[{extra}]'")


class MissingExtra(ImportError):
    """An optional dependency is missing (or cannot load); the message says what to
    install. Raised where a plain ``ModuleNotFoundError`` would not say enough (e.g. the
    Mooncake wheel is there but its system libraries are not)."""


def explain(exc: BaseException) -> str | None:
    """The one-line message for ``exc`` when it (or what it was raised from) is a missing
    optional dependency, else ``None``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MissingExtra):
            return str(seen)
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            top = seen.name.split(".", 1)[0]
            extra = EXTRA_OF.get(top)
            if extra is not None:
                return (f"this command needs {top}, which is not installed: "
                        f"{install_hint(extra)}")
        seen = seen.__cause__  # raised "from" it; an error merely during another is not
    return None


def run_cli(prog: str, main: Callable[[list[str] | None], int],
            argv: list[str] | None = None) -> int:
    """``main(argv)``; a missing optional dependency is one line on stderr and exit 2."""
    try:
        return main(argv)
    except ImportError as exc:
        message = explain(exc)
        if message is None:
            raise
        print(f"{prog}: {message}", file=sys.stderr)
        return 2
