"""Who may call the router and what one request may ask for: the ``auth`` and ``limits``
sections of the router config, parsed once into frozen dataclasses (``ValueError`` names the
bad field).

Environment variables (read by :meth:`AuthConfig.parse` from the mapping
:func:`kvcentric.router.config.load_config` passes, never from ``os.environ`` here):
``KVCENTRIC_ROUTER_API_KEYS`` (``key=tenant,key2=tenant2``, added to ``auth.api_keys``),
``KVCENTRIC_ROUTER_ADMIN_KEY``, ``KVCENTRIC_ROUTER_METRICS_KEY``,
``KVCENTRIC_ROUTER_SALT_SECRET`` and ``KVCENTRIC_ROUTER_SALT_SECRET_FILE`` (a file holding
the salt secret, e.g. a mounted Kubernetes Secret; read here, once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcentric.config import parse_fields
from kvcentric.router.chat_template import check_allow_list
from kvcentric.router.fleet.instance_spec import NAME_FORM, NAME_RE

ENV_API_KEYS = "KVCENTRIC_ROUTER_API_KEYS"
ENV_ADMIN_KEY = "KVCENTRIC_ROUTER_ADMIN_KEY"
ENV_METRICS_KEY = "KVCENTRIC_ROUTER_METRICS_KEY"
ENV_SALT_SECRET = "KVCENTRIC_ROUTER_SALT_SECRET"
ENV_SALT_SECRET_FILE = "KVCENTRIC_ROUTER_SALT_SECRET_FILE"
MIN_KEY = 8
MIN_SECRET = 16
INT64 = 2**63


def check_positive(obj: object, *names: str) -> None:
    """``ValueError`` unless each named field of ``obj`` is a positive number; the message
    names the field as the YAML does (``health.interval_s``: the section is the class name
    less ``Config``, in lower case)."""
    section = type(obj).__name__.removesuffix("Config").lower()
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{section}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class AuthConfig:
    """Who may call the router.

    ``api_keys``: ``(key, tenant)`` pairs (YAML: a mapping ``key: tenant``); every key,
    these and the admin and metrics keys, has at least :data:`MIN_KEY` characters. With any key
    set, every ``/v1/*`` request needs ``Authorization: Bearer <key>`` (else 401) and runs
    as the key's tenant: its KV is salted with the tenant (an HMAC of the tenant under
    ``salt_secret``), so tenants never share KV and one tenant's users still share theirs.
    ``admin_key``: needed for ``/instances``; with keys but no admin key the admin
    endpoints are closed. ``metrics_key``: may read ``/metrics`` and ``/dashboard`` (so may
    the admin key); with any key configured those need one of the two (closed when there
    is neither). ``salt_secret``: the key of the tenant salts (at least 16 characters; YAML
    ``salt_secret`` or ``salt_secret_file``); without one a keyed router draws a random one
    at start and warns (salts then change on every restart and differ between routers).
    ``allow_open``: listen on a non-loopback address without keys (refused otherwise).
    """

    api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    admin_key: str | None = field(default=None, repr=False)
    metrics_key: str | None = field(default=None, repr=False)
    salt_secret: str | None = field(default=None, repr=False)
    allow_open: bool = False

    def __post_init__(self) -> None:
        for key, tenant in self.api_keys:
            if not isinstance(tenant, str) or not NAME_RE.fullmatch(tenant):
                raise ValueError(f"auth.api_keys (or {ENV_API_KEYS}): tenant {tenant!r} "
                                 f"must be {NAME_FORM}")
            if not isinstance(key, str) or len(key) < MIN_KEY:
                size = len(key) if isinstance(key, str) else 0
                raise ValueError(f"auth.api_keys (or {ENV_API_KEYS}): the key of tenant "
                                 f"{tenant!r} has {size} characters; a key needs at least "
                                 f"{MIN_KEY}")
        tenant_keys = {k for k, _ in self.api_keys}
        if len(tenant_keys) != len(self.api_keys):
            raise ValueError("auth.api_keys has a key twice")
        for name in ("admin_key", "metrics_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) < MIN_KEY):
                size = len(value) if isinstance(value, str) else 0
                raise ValueError(f"auth.{name} has {size} characters; it needs at least "
                                 f"{MIN_KEY}")
            if value in tenant_keys:
                raise ValueError(f"auth.{name} must differ from every tenant key")
        if self.metrics_key is not None and self.metrics_key == self.admin_key:
            raise ValueError("auth.metrics_key must differ from auth.admin_key")
        if self.salt_secret is not None and (not isinstance(self.salt_secret, str)
                                             or len(self.salt_secret) < MIN_SECRET):
            raise ValueError(f"auth.salt_secret must be a string of >= {MIN_SECRET} "
                             "characters")
        if not isinstance(self.allow_open, bool):
            raise ValueError("auth.allow_open must be true or false")

    @property
    def enabled(self) -> bool:
        """Tenant keys are configured: ``/v1/*`` needs one."""
        return bool(self.api_keys)

    @property
    def keyed(self) -> bool:
        """Any key is configured: ``/metrics`` and ``/dashboard`` need the admin or the
        metrics key."""
        return self.enabled or self.admin_key is not None or self.metrics_key is not None

    @classmethod
    def parse(cls, raw: Any, env: Mapping[str, str]) -> AuthConfig:
        kw = parse_fields(cls, raw, "auth", ignore={"salt_secret_file"})
        keys = kw.get("api_keys") or {}
        if not isinstance(keys, Mapping):
            raise ValueError("auth.api_keys must be a mapping of key: tenant")
        pairs = [(str(k), v) for k, v in keys.items()]
        for item in filter(None, env.get(ENV_API_KEYS, "").split(",")):
            key, sep, tenant = item.strip().partition("=")
            if not sep:
                raise ValueError(f"{ENV_API_KEYS} entries are key=tenant, got {item!r}")
            pairs.append((key, tenant))
        kw["api_keys"] = tuple(pairs)
        for name, var in (("admin_key", ENV_ADMIN_KEY), ("metrics_key", ENV_METRICS_KEY),
                          ("salt_secret", ENV_SALT_SECRET)):
            if env.get(var):
                kw[name] = env[var]
        path = env.get(ENV_SALT_SECRET_FILE) or (raw or {}).get("salt_secret_file")
        if path:
            kw["salt_secret"] = _read_secret(Path(path))
        return cls(**kw)


def _read_secret(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"auth.salt_secret_file {str(path)!r}: cannot read it: {exc}") from exc


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on one request. Over a bound: 413 (body), 400 (anything in the body, the
    prompt's size: ``context_length_exceeded``), 429 with ``Retry-After`` (a key's requests
    in flight; without keys all clients share one budget).

    ``max_model_len``: the engines' context; ``None``: the smallest ``max_model_len`` the
    engines report (``/v1/models``), before that the model's ``config.json``.
    ``max_prompt_tokens``: ``None``: the context less one (vLLM's rule: a prompt must leave
    room for a token). ``max_prompt_chars``: the rendered prompt's size, checked before it
    is tokenised; ``None``: prompt tokens times the tokenizer's longest token (vLLM's
    bound). ``max_tokens``: ``None``: the context; a request naming no budget gets this one
    when set. Requests in flight per key (without keys: in all): at most
    ``max_concurrency_per_key`` and at most ``max_concurrency_per_instance`` times the
    instances the router knows (``None``: no such bound). The second scales with the
    fleet, as the engines' own sequence slots do: a fixed bound sized for one engine
    refused requests that a fleet of them had room for.
    ``max_n``, ``max_logprobs`` (vLLM's ``--max-logprobs``), ``min_priority`` ..
    ``max_priority`` (0 .. 0 unless the engines schedule by priority and tenants may use
    it): bounds on those request fields. ``chat_template_kwargs``: the keys a chat may set
    there; ``None``: the variables the model's chat template reads
    (:mod:`kvcentric.router.chat_template`).
    """

    max_body_bytes: int = 4 << 20
    max_model_len: int | None = None
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    max_tokens: int | None = None
    max_concurrency_per_key: int | None = None
    max_concurrency_per_instance: int | None = 256
    retry_after_s: int = 1
    max_n: int = 4
    max_logprobs: int = 20
    min_priority: int = 0
    max_priority: int = 0
    chat_template_kwargs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_positive(self, "max_body_bytes", "retry_after_s", "max_n")
        for name in ("max_model_len", "max_prompt_tokens", "max_prompt_chars", "max_tokens",
                     "max_concurrency_per_key", "max_concurrency_per_instance"):
            if getattr(self, name) is not None:
                check_positive(self, name)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("limits.max_model_len must be >= 2 (a prompt and a token)")
        for name in ("max_logprobs", "min_priority", "max_priority"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"limits.{name} must be an integer, got {value!r}")
        if self.max_logprobs < 0:
            raise ValueError("limits.max_logprobs must be >= 0")
        if not -INT64 <= self.min_priority <= self.max_priority < INT64:
            raise ValueError("limits.min_priority <= max_priority, both 64-bit integers")
        if self.chat_template_kwargs is not None:
            object.__setattr__(self, "chat_template_kwargs",
                               check_allow_list(self.chat_template_kwargs))

    @classmethod
    def parse(cls, raw: Any) -> LimitsConfig:
        kw = parse_fields(cls, raw, "limits", sizes={"max_body_bytes"})
        names = kw.get("chat_template_kwargs")
        if names is not None:
            if isinstance(names, str) or not isinstance(names, (list, tuple)):
                raise ValueError("limits.chat_template_kwargs must be a list of names")
            kw["chat_template_kwargs"] = tuple(names)
        return cls(**kw)
