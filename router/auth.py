"""Who is calling: API keys mapped to tenants, the admin key, each tenant's KV namespace.

With keys configured (:class:`kvcentric.router.config.AuthConfig`) every OpenAI request
carries ``Authorization: Bearer <key>``; the key names the tenant. A tenant's requests get
``cache_salt = "kvct-<16 hex of sha256(tenant)>"``, and a client's own salt goes after it
(``"kvct-<hex>.<salt>"``): the engines and the store hash the salt into every block key,
so two tenants never share KV for the same prompt, while one tenant's requests (with the
same client salt) still do. The tenant part has a fixed length, so no (tenant, salt) pair
can spell another's; it avoids what vLLM refuses in a salt (``@``, ``/``, a backslash,
NUL) and leaves :data:`CLIENT_SALT_MAX` of vLLM's 128 characters to the client. Without
keys the router is open: no salt is added and everyone shares one concurrency budget.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from kvcentric.router.config import AuthConfig
from kvcentric.router.errors import Refused

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvcentric-router"'}
SALT_MAX = 128  # vLLM's bound on cache_salt
_TENANT_PART = len("kvct-") + 16
CLIENT_SALT_MAX = SALT_MAX - _TENANT_PART - 1


@dataclass(frozen=True)
class Caller:
    """The authenticated caller: ``tenant`` (None on an open router) and ``budget``, the
    name its concurrency is counted under."""

    tenant: str | None
    budget: str


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class Authenticator:
    """Checks keys (compared as SHA-256 digests, so lookups leak no key bytes by timing)."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.enabled = cfg.enabled
        self._tenants = {_digest(k): t for k, t in cfg.api_keys}
        self._admin = _digest(cfg.admin_key) if cfg.admin_key else None

    def caller(self, headers: Mapping[str, str]) -> Caller:
        """The caller of an OpenAI request; :class:`Refused` (401) without a valid key."""
        if not self.enabled:
            return Caller(None, "")
        token = bearer(headers)
        if token is None:
            raise Refused(401, "missing API key: send 'Authorization: Bearer <key>'",
                          _CHALLENGE)
        tenant = self._tenants.get(_digest(token))
        if tenant is None:
            raise Refused(401, "invalid API key", _CHALLENGE)
        return Caller(tenant, tenant)

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """Allow an admin request or raise :class:`Refused`: 401 without a valid key, 403
        for a tenant key or when the admin endpoints are closed (keys, no admin key)."""
        if self._admin is None:
            if not self.enabled:
                return  # an open router (loopback, no keys): admin is open too
            raise Refused(403, "the admin endpoints are closed: no admin key is configured")
        token = bearer(headers)
        if token is None:
            raise Refused(401, "missing admin key: send 'Authorization: Bearer <key>'",
                          _CHALLENGE)
        digest = _digest(token)
        if hmac.compare_digest(digest, self._admin):
            return
        if digest in self._tenants:
            raise Refused(403, "a tenant key cannot use the admin endpoints")
        raise Refused(401, "invalid admin key", _CHALLENGE)

    @staticmethod
    def salt(caller: Caller, client_salt: str | None) -> str | None:
        """The ``cache_salt`` a request runs with (see the module docstring)."""
        if caller.tenant is None:
            return client_salt
        base = "kvct-" + hashlib.sha256(caller.tenant.encode()).hexdigest()[:16]
        return base if client_salt is None else f"{base}.{client_salt}"
