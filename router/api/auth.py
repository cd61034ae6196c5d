"""Who is calling: API keys mapped to tenants, the admin and metrics keys, each tenant's KV
namespace.

With keys configured (:class:`kvcentric.router.config.AuthConfig`) every OpenAI request
carries ``Authorization: Bearer <key>``; the key names the tenant. A tenant's requests get
``cache_salt = "kvct-<16 hex of HMAC-SHA256(salt_secret, tenant)>"``, and a client's own
salt goes after it (``"kvct-<hex>.<salt>"``): the engines and the store hash the salt into
every block key, so two tenants never share KV for the same prompt, while one tenant's
requests (with the same client salt) still do. The salt is keyed: without the server's
secret nobody can compute a tenant's salt, so nobody can confirm a guessed prompt of
another tenant offline from block hashes (an unkeyed ``sha256(tenant)`` allowed that).
The tenant part has a fixed length, so no (tenant, salt) pair can spell another's; it
avoids what vLLM refuses in a salt (``@``, ``/``, a backslash, NUL) and leaves
:data:`CLIENT_SALT_MAX` of vLLM's 128 characters to the client.

Rotating the secret changes every tenant's salt at once: KV stored under the old salts is
never read again (it ages out of the engines and the store) and every prefix is computed
once more. Give every router of a fleet the same secret (a Secret), and change it on all
of them together. Without a configured secret a keyed router draws a random one at start
(and warns): salts then change on each restart and differ between routers.

Without keys the router is open: no salt is added and everyone shares one concurrency
budget. ``/metrics`` and ``/dashboard`` show per-instance load and hot-prefix hashes: with
any key configured they need the admin or the metrics key, as ``Bearer`` (Prometheus'
``authorization``) or as the password of HTTP ``Basic`` (a browser asks for it once and
sends it with the dashboard's own requests).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from kvcentric.router.api.access_config import AuthConfig
from kvcentric.router.api.errors import Refused

log = logging.getLogger("router.api.auth")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvcentric-router"'}
# Basic first: a browser opening /dashboard then asks for the key (any user name)
_METRICS_CHALLENGE = {"WWW-Authenticate": 'Basic realm="kvcentric-router metrics", '
                                          'Bearer realm="kvcentric-router metrics"'}
SALT_MAX = 128  # vLLM's bound on cache_salt
SALT_PREFIX = "kvct-"
_TENANT_PART = len(SALT_PREFIX) + 16
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


def basic_password(headers: Mapping[str, str]) -> str | None:
    """The password of an ``Authorization: Basic <base64(user:password)>`` header."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, sep, password = decoded.partition(":")
    return password or None if sep else None


class Authenticator:
    """Checks keys (compared as SHA-256 digests, so lookups leak no key bytes by timing)."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.enabled = cfg.enabled
        self.keyed = cfg.keyed
        self._tenants = {_digest(k): t for k, t in cfg.api_keys}
        self._admin = _digest(cfg.admin_key) if cfg.admin_key else None
        self._metrics = _digest(cfg.metrics_key) if cfg.metrics_key else None
        secret = cfg.salt_secret
        if secret is None and cfg.enabled:
            log.warning("auth.salt_secret is not set: tenant salts use a random secret that "
                        "changes on restart (and differs between routers), so stored KV is "
                        "not found again after one; set auth.salt_secret_file or "
                        "KVCENTRIC_ROUTER_SALT_SECRET")
        self._salt_key = (secret or secrets.token_hex(32)).encode()

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

    def check_metrics(self, headers: Mapping[str, str]) -> None:
        """Allow a ``/metrics`` or ``/dashboard`` request: open without any key configured,
        else the admin or the metrics key (Bearer, or Basic's password); 401 without a
        valid one, 403 for a tenant key or when neither key is configured."""
        if not self.keyed:
            return
        allowed = [d for d in (self._admin, self._metrics) if d is not None]
        if not allowed:
            raise Refused(403, "/metrics is closed: configure auth.metrics_key or "
                          "auth.admin_key to read it")
        token = bearer(headers) or basic_password(headers)
        if token is None:
            raise Refused(401, "missing metrics key: send 'Authorization: Bearer <key>' "
                          "(the admin or the metrics key)", _METRICS_CHALLENGE)
        digest = _digest(token)
        if any(hmac.compare_digest(digest, d) for d in allowed):
            return
        if digest in self._tenants:
            raise Refused(403, "a tenant key cannot read the router's metrics")
        raise Refused(401, "invalid metrics key", _METRICS_CHALLENGE)

    def salt(self, caller: Caller, client_salt: str | None) -> str | None:
        """The ``cache_salt`` a request runs with (see the module docstring)."""
        if caller.tenant is None:
            return client_salt
        mac = hmac.new(self._salt_key, caller.tenant.encode(), hashlib.sha256)
        base = SALT_PREFIX + mac.hexdigest()[:16]
        return base if client_salt is None else f"{base}.{client_salt}"
