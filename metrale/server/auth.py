"""API-key authentication: `Authorization: Bearer <key>` or `x-api-key: <key>`.

Owner: server.

Invariants:
- With no key configured every request passes; with one, every path except `OPEN_PATHS`
  needs it, and a missing or wrong key gets 401 in the error shape of the route's protocol.
- Keys are compared in constant time.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.errors import AuthenticationError
from metrale.server.errors import error_response, is_anthropic_path

#: Paths that never need the key: liveness probes and Prometheus scrapes (no request data).
OPEN_PATHS = frozenset({"/health", "/metrics"})


def presented_key(scope: Scope) -> str | None:
    headers = dict(scope.get("headers") or [])
    auth = headers.get(b"authorization", b"").decode("latin-1").strip()
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope)
        if key is None:
            error = AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key')"
            )
        elif not hmac.compare_digest(key.encode("latin-1", "replace"), self.api_key):
            error = AuthenticationError("invalid API key")
        else:
            await self.app(scope, receive, send)
            return
        response = error_response(error, anthropic=is_anthropic_path(scope["path"]))
        await response(scope, receive, send)
