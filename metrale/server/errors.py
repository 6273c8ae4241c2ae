"""The one place where errors become HTTP responses and stream error frames.

Owner: server. Every route raises `metrale.errors.*`; this module turns them (and anything
unexpected) into the OpenAI error shape `{"error": {"message", "type", "param", "code"}}`
with the status the exception class names. Anthropic routes get the same object under
`{"type": "error", "error": {...}}`, which both SDKs parse.

Invariants:
- A client never sees a traceback: an unexpected exception is logged here and answered with a
  500 whose message names only the exception type.
- 503 answers (queue full, engine dead or shutting down) carry `Retry-After`.
- Every message and param is safe to write whatever value it echoes: lone surrogates become
  U+FFFD and text past `MAX_ECHO_CHARS` is cut (`safe_text`), so an error answer can never
  fail to encode or echo a huge body back.
- `code` is a stable machine-readable string (`context_length_exceeded`, `model_not_found`,
  `invalid_api_key`, ...) or null.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from starlette.responses import JSONResponse

from metrale.errors import (
    AuthenticationError,
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    MetraleError,
    NotFoundError,
    QueueFullError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
#: Longest message (characters) an error answer carries; an echoed value is cut to fit.
MAX_ECHO_CHARS = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_text(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` as it may be written to a client: valid Unicode (a lone surrogate becomes U+FFFD)
    and at most `limit` characters (cut with "...")."""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return _SURROGATE.sub("\ufffd", text)


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413


class InternalServerError(MetraleError):
    """An unexpected failure inside one request; the others are unaffected."""


def _code(exc: MetraleError) -> str | None:
    explicit = getattr(exc, "code", None)
    if isinstance(explicit, str):
        return explicit
    if isinstance(exc, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(exc, NotFoundError):
        return "model_not_found" if exc.param == "model" else "not_found"
    if isinstance(exc, AuthenticationError):
        return "invalid_api_key"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, EngineDeadError):
        return "engine_unavailable"
    return None


def as_metrale_error(exc: BaseException) -> MetraleError:
    """`exc` itself if it is a MetraleError, else a 500 that hides the internals (logged)."""
    if isinstance(exc, MetraleError):
        return exc
    logger.error("request failed unexpectedly", exc_info=exc)
    return InternalServerError(f"internal server error ({type(exc).__name__})")


def error_object(exc: BaseException) -> dict[str, Any]:
    err = as_metrale_error(exc)
    return {
        "message": safe_text(str(err.message)),
        "type": err.error_type,
        "param": safe_text(err.param, 256) if isinstance(err.param, str) else err.param,
        "code": _code(err),
    }


def error_body(exc: BaseException, *, anthropic: bool = False) -> dict[str, Any]:
    if anthropic:
        return {"type": "error", "error": error_object(exc)}
    return {"error": error_object(exc)}


def error_headers(exc: BaseException) -> dict[str, str]:
    err = as_metrale_error(exc)
    headers: dict[str, str] = {}
    if err.status_code == 503:
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    if isinstance(err, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_response(exc: BaseException, *, anthropic: bool = False) -> JSONResponse:
    err = as_metrale_error(exc)
    return JSONResponse(
        error_body(err, anthropic=anthropic),
        status_code=err.status_code,
        headers=error_headers(err),
    )


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def http_error(status_code: int, message: str) -> MetraleError:
    """A MetraleError for a framework-level HTTP error (unknown route, wrong method)."""
    err = MetraleError(message)
    err.status_code = status_code
    err.error_type = "not_found_error" if status_code == 404 else "invalid_request_error"
    return err
