"""The one exception hierarchy of metrale.

Owner: every layer raises these; the server maps them to HTTP status codes in one place
(`metrale.server.errors`), the CLI prints their message.

Invariants:
- Every error a user can cause carries a message that names the offending thing (file, tensor,
  parameter, architecture) and, where it applies, the request parameter in `param`.
- `status_code` is the HTTP status a server answers with; it never depends on where the error
  was raised.
"""

from __future__ import annotations


class MetraleError(Exception):
    """Base class of every error metrale raises on purpose."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(MetraleError, ValueError):
    """A request (prompt, sampling parameters, body) is malformed or out of range."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """The prompt, or prompt plus requested tokens, does not fit the model's context."""


class CapacityError(InvalidRequestError):
    """The request can never fit the engine's resources (KV pool, slots), whatever waits."""


class QueueFullError(MetraleError):
    """The engine's request queue is full; the client should retry later."""

    status_code = 503
    error_type = "server_overloaded"


class AuthenticationError(MetraleError):
    status_code = 401
    error_type = "authentication_error"


class NotFoundError(MetraleError):
    status_code = 404
    error_type = "not_found_error"


class Unsupported(MetraleError, NotImplementedError):
    """A capability this model or build does not have (the seed's default refusal)."""

    status_code = 400
    error_type = "unsupported"


class CheckpointError(MetraleError):
    """A checkpoint directory is unusable: unknown architecture, missing or bad weights."""

    error_type = "checkpoint_error"


class KVCacheExhausted(MetraleError):
    """The KV block pool has no free block for an allocation the caller asked for."""

    status_code = 503
    error_type = "kv_cache_exhausted"


class EngineDeadError(MetraleError):
    """The engine loop stopped; no request can be served any more."""

    status_code = 503
    error_type = "engine_dead"
