"""API-key authentication: `Authorization: Bearer <key>` or `x-api-key: <key>`; and the tenant
of the cross-request draft lookup, which the key decides.

Owner: server.

Invariants:
- With no key configured every request passes; with one or several (`--api-key` repeated, or
  `--api-key-file`), every path except `OPEN_PATHS` needs one of them, and a missing or wrong
  key gets 401 in the error shape of the route's protocol.
- Keys are compared in constant time, against every configured key (no early exit).
- A request that passed the check carries the key it matched in its ASGI scope
  (`AUTHENTICATED_KEY`; read by `authenticated_key`); a server without keys sets nothing.
- `lookup_tenant` never returns the key itself, only a hash of it, and a request's explicit
  `tenant` can only subdivide its key's tenant, never reach another key's. Each key is its own
  tenant (also of the prefix cache under `--prefix-cache-isolation api-key`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.engine.engine import DEFAULT_TENANT
from metrale.errors import AuthenticationError
from metrale.server.errors import error_response, is_anthropic_path

#: Paths that never need the key: liveness probes, Prometheus scrapes, the server's version and
#: the API schema and its page (no request data, nothing of the model's).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs"})
#: The ASGI scope key (an extension key) holding the API key a request authenticated with.
AUTHENTICATED_KEY = "metrale.api_key"
#: Hex digits of sha256(key) that name a key's tenant (64 bits: no collisions in practice).
TENANT_HASH_HEX = 16


def presented_key(scope: Scope) -> str | None:
    headers = dict(scope.get("headers") or [])
    auth = headers.get(b"authorization", b"").decode("latin-1").strip()
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


def authenticated_key(scope: Scope) -> str | None:
    """The API key this request authenticated with; None when the server has no keys."""
    key = scope.get(AUTHENTICATED_KEY)
    return key if isinstance(key, str) else None


def lookup_tenant(api_key: str | None, tenant: str | None = None) -> str:
    """The tenant of a request's cross-request draft lookup (`Engine.add_request`'s
    `lookup_tenant`): requests share draft sources only within one tenant.

    `api_key` is the key the request authenticated with (`authenticated_key`), None on a
    server without keys. Its tenant is "key:<first 16 hex digits of sha256(key)>" (the key
    itself never appears); without a key it is `DEFAULT_TENANT`. An explicit `tenant` (the
    body's field) subdivides it: "<key tenant>/<tenant>". The key part always comes from the
    credential, never from the body, so a client can partition its own tenant but cannot name
    its way into another key's. An empty `tenant` is the same as none."""
    if api_key is None:
        base = DEFAULT_TENANT
    else:
        digest = hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()
        base = f"key:{digest[:TENANT_HASH_HEX]}"
    return f"{base}/{tenant}" if tenant else base


def api_keys(api_key: str | Sequence[str] | None) -> list[str]:
    """The configured keys: one string, several, or none (empty strings dropped)."""
    if api_key is None:
        return []
    keys = [api_key] if isinstance(api_key, str) else list(api_key)
    return [k for k in keys if k]


def read_key_file(path: str) -> list[str]:
    """The keys of a keys file: one per line; blank lines and `#` comments skipped."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    return [line for line in lines if line and not line.startswith("#")]


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | Sequence[str] | None) -> None:
        self.app = app
        self.keys = api_keys(api_key)
        self.encoded = [k.encode("utf-8", "surrogatepass") for k in self.keys]

    def _match(self, presented: str) -> str | None:
        raw = presented.encode("latin-1", "replace")
        found = None
        for key, encoded in zip(self.keys, self.encoded):
            if hmac.compare_digest(raw, encoded):
                found = key
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keys or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope)
        matched = self._match(key) if key is not None else None
        if key is None:
            error = AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key')"
            )
        elif matched is None:
            error = AuthenticationError("invalid API key")
        else:
            await self.app({**scope, AUTHENTICATED_KEY: matched}, receive, send)
            return
        response = error_response(error, anthropic=is_anthropic_path(scope["path"]))
        await response(scope, receive, send)
