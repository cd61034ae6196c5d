"""One engine behind the router, as the router config and ``POST /instances`` name it.

Parsed once (``ValueError`` names the bad field); the router's other modules take an
:class:`InstanceSpec` as checked. What is accepted is exactly :data:`PATTERNS` (and
:data:`ROLES`), the patterns ``POST /instances`` publishes (:mod:`kvcentric.router.api.openapi`):
a body the schema refuses is refused here, and the reverse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from kvcentric.config import parse_fields

ROLES = ("prefill", "decode", "both")
# The engine behind an instance: its metrics names, its KV events' fields, its P/D protocol
# (docs/router.md §SGLang instances)
KINDS = ("vllm", "sglang")
NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
# tcp://HOST:PORT (the router binds; HOST "*": the engine binds, the router connects to the
# instance's host), ipc:///path or inproc://name (the engine binds, the router connects)
KV_EVENTS_RE = re.compile(rf"tcp://(\*|[A-Za-z0-9.-]+):{_PORT}|ipc://[A-Za-z0-9_./-]+"
                          r"|inproc://[A-Za-z0-9_./-]+")
# The string fields as JSON Schema patterns: the published schema of POST /instances and
# the check here are these very strings, matched as JSON Schema does (a search, ``^`` at the
# start). ``(?![\s\S])`` ends them: ``$`` would also match before a final newline in
# Python (and in the fuzzers that generate from Python regexes), not in ECMA-262.
_END = r"(?![\s\S])"
PATTERNS = {
    "url": rf"^https?://[A-Za-z0-9.-]+(:{_PORT})?/?{_END}",
    "name": rf"^{NAME_RE.pattern}{_END}",
    "model": rf"^[!-~]{{1,256}}{_END}",  # printable ASCII, no spaces
    "kv_events": rf"^({KV_EVENTS_RE.pattern}){_END}",
    "kv_events_replay": rf"^({KV_EVENTS_RE.pattern}){_END}",
    "compute": rf"^{NAME_RE.pattern}{_END}",
}


NAME_FORM = "1 to 64 letters, digits, '_', '.', ':' or '-'"
_EVENTS_FORM = ("tcp://HOST:PORT (the router binds), tcp://*:PORT (the engine binds), "
                "ipc:///path or inproc://name")
# What each field must look like, in words: an error names the field and this, never the
# pattern (a regex dump tells a user nothing about what to write).
FORMS = {
    "url": "http://HOST[:PORT] or https://HOST[:PORT], no path (e.g. http://127.0.0.1:8100)",
    "name": NAME_FORM,
    "model": "1 to 256 printable ASCII characters without spaces",
    "kv_events": _EVENTS_FORM,
    "kv_events_replay": _EVENTS_FORM,
    "compute": NAME_FORM,
}


def _check(field: str, value: Any, nullable: bool = True) -> None:
    """``ValueError`` unless ``value`` is a string matching ``PATTERNS[field]`` (or None);
    the message names the field and its expected form (:data:`FORMS`)."""
    if value is None and nullable:
        return
    if not isinstance(value, str) or not re.search(PATTERNS[field], value):
        shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:60]}... " \
            f"({len(value) if isinstance(value, str) else len(repr(value))} characters)"
        hint = ""
        if field == "url" and isinstance(value, str) and "://" not in value:
            hint = f"; did you mean http://{value}?"
        raise ValueError(f"instance {field} {shown} must be {FORMS[field]}{hint}")


@dataclass(frozen=True)
class InstanceSpec:
    """One engine behind the router.

    ``role``: ``prefill`` (kv_producer), ``decode`` (kv_consumer) or ``both`` (kv_both, or
    no connector). ``kv_events``: the ZMQ endpoint the engine publishes KV cache events to
    (``tcp://127.0.0.1:PORT``: the engine connects and the router binds; ``ipc://...``:
    the engine binds and the router connects); ``None``: the router's own bookkeeping.
    ``kv_events_replay``: the engine's replay endpoint (vLLM's ``replay_endpoint``, which
    the engine binds; the router connects): a router (re)starting, or seeing batches lost,
    asks it for the engine's buffered event batches, so that its residency view is rebuilt
    from the engine instead of starting empty. Needs ``kv_events``.
    ``compute``: instances naming the same compute share one processor (several engines
    on one GPU, or vLLM CPU engines bound to the same cores); the cost model splits it
    fairly between those with prefills to do instead of counting each at full speed.
    ``kind``: the engine, ``vllm`` or ``sglang``. It decides how the router reads the
    engine's ``/metrics`` and KV events and how it runs a disaggregated request: a vLLM
    prefill runs first and its connector saves the KV to the store, for the decode to
    load; an SGLang pair gets the request at once, both with the same ``bootstrap_room``,
    and SGLang's own transfer moves the KV (its disaggregation protocol, as sglang-router
    drives it). Pairs are never mixed: a prefill and a decode are of one kind.
    ``bootstrap_port``: an SGLang prefill server's ``--disaggregation-bootstrap-port``,
    sent to the decode with each request; ``None``: the router reads it from the
    server's ``/server_info`` (its ``disaggregation_bootstrap_port``).
    """

    url: str
    role: str = "both"
    model: str | None = None
    name: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    compute: str | None = None
    kind: str = "vllm"
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        _check("url", self.url, nullable=False)
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not isinstance(self.role, str) or self.role not in ROLES:
            raise ValueError(f"instance role {self.role!r} must be one of {ROLES}")
        if self.name is None:
            object.__setattr__(self, "name", urlparse(self.url).netloc)
        for name in ("name", "model", "kv_events", "kv_events_replay", "compute"):
            _check(name, getattr(self, name))
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events (the live stream)")
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError(f"instance kind {self.kind!r} must be one of {KINDS}")
        port = self.bootstrap_port
        if port is not None:
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ValueError(f"instance bootstrap_port {port!r} must be a port, 1 to "
                                 "65535")
            if not self.sglang_prefill:
                raise ValueError("bootstrap_port is an SGLang prefill server's: it needs "
                                 "kind sglang and role prefill")

    @classmethod
    def from_dict(cls, raw: Any) -> InstanceSpec:
        if not isinstance(raw, Mapping) or "url" not in raw:
            raise ValueError(f"an instance needs at least a url, got {raw!r}")
        return cls(**parse_fields(cls, raw, "instance"))

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def sglang_prefill(self) -> bool:
        """An SGLang prefill server: it serves a request only as half of a bootstrapped
        pair (with a ``bootstrap_room``, its decode server fetching the KV)."""
        return self.kind == "sglang" and self.role == "prefill"

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")
