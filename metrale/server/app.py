"""`create_app`: the FastAPI application around one engine handle (`AsyncEngine` in-process,
or `EngineProcess`).

Owner: server. Routes: `GET /health`, `GET /metrics`, `GET /openapi.json` (the request bodies'
schemas) and `GET /docs` (FastAPI's page over it), `GET /version`, `GET /v1/models[/{id}]`,
`POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/messages`,
`POST /v1/messages/count_tokens`, `POST /v1/embeddings`, `POST /v1/responses` (and `GET` / `DELETE` of a stored one),
`POST /tokenize`, `POST /detokenize`, and `POST /v1/load_lora_adapter` /
`POST /v1/unload_lora_adapter` (`routes/lora.py`).

Invariants:
- Middleware order, outermost first: request metrics (status of every answer, in-flight
  gauge), body-size limit (413), API key (401), catch-all (500). Every error, including
  unknown routes (404),
  wrong methods (405), bad JSON and unexpected exceptions (500), is answered in the OpenAI
  error shape by `metrale.server.errors`; no traceback reaches a client.
- The app holds no global state: everything lives on `app.state.metrale` (a `ServerState`).
- The lifespan starts the engine (its thread, or the reader of its process) if it is not
  running and stops it at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.engine.async_engine import EngineHandle
from metrale.errors import InvalidRequestError, MetraleError
from metrale.sampling.params import MAX_LOGPROBS
from metrale.server.auth import ApiKeyMiddleware, api_keys
from metrale.server.errors import (
    PayloadTooLargeError,
    error_response,
    http_error,
    is_anthropic_path,
)
from metrale.server.metrics import ServerMetrics, endpoint_label
from metrale.server.routes import anthropic as anthropic_routes
from metrale.server.routes import completions as completion_routes
from metrale.server.routes import embeddings as embeddings_routes
from metrale.server.routes import lora as lora_routes
from metrale.server.routes import openai as openai_routes
from metrale.server.routes import responses as responses_routes
from metrale.server.routes import utility as utility_routes
from metrale.server.state import MAX_BODY_BYTES, ServerState, server_state
from metrale.server.streaming import ClientDisconnected

logger = logging.getLogger(__name__)

#: `--prefix-cache-isolation` choices: one shared prefix cache, or one per API key.
PREFIX_CACHE_ISOLATION = ("none", "api-key")
#: Status recorded for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


class _MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED_REQUEST

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        self.metrics.requests_active.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            if status == CLIENT_CLOSED_REQUEST:
                status = 500  # answered by the outermost error handler
            raise
        finally:
            self.metrics.requests_active.dec()
            self.metrics.requests.labels(endpoint_label(scope["path"]), str(status)).inc()


class _CatchAllMiddleware:
    """Answers an unexpected exception of a route with a 500 (logged once, here)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if started or scope["type"] != "http":
                logger.error("request failed after its response started", exc_info=exc)
                return
            response = error_response(exc, anthropic=is_anthropic_path(scope["path"]))
            await response(scope, receive, send)


class _BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.limit:
                error = PayloadTooLargeError(f"the request body is larger than {self.limit} bytes")
                response = error_response(error, anthropic=is_anthropic_path(scope["path"]))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    engine: EngineHandle,
    *,
    api_key: str | Sequence[str] | None = None,
    served_model_name: str | Sequence[str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_prompt_tokens: int | None = None,
    prefix_cache_isolation: str = "none",
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    strict_request_fields: bool = False,
    max_logprobs: int = MAX_LOGPROBS,
    pooling: str = "last",
    enable_lora_runtime_updates: bool = False,
) -> FastAPI:
    """The app over `engine`. `api_key`: one key or several (each its own tenant);
    `prefix_cache_isolation`: "none" or "api-key" (a prefix cache per key; needs a key)."""
    keys = api_keys(api_key)
    if prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
        raise InvalidRequestError(
            f"prefix_cache_isolation must be one of {', '.join(PREFIX_CACHE_ISOLATION)}, got "
            f"{prefix_cache_isolation!r}",
            param="prefix_cache_isolation",
        )
    if prefix_cache_isolation == "api-key" and not keys:
        raise InvalidRequestError(
            "--prefix-cache-isolation api-key needs at least one --api-key",
            param="prefix_cache_isolation",
        )
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    model_name = names[0] if names else engine.info.served_model_name
    metrics = ServerMetrics(engine, model_name)
    state = ServerState(
        engine=engine,
        tokenizer=engine.tokenizer,
        model_name=model_name,
        model_aliases=tuple(names[1:]) if names else (),
        max_model_len=engine.info.max_model_len,
        metrics=metrics,
        api_key=keys[0] if keys else None,
        prefix_cache_isolation=prefix_cache_isolation,
        max_body_bytes=max_body_bytes,
        max_prompt_tokens=max_prompt_tokens,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        strict_request_fields=strict_request_fields,
        max_logprobs=max_logprobs,
        pooling=pooling,
        lora_runtime_updates=enable_lora_runtime_updates,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(
        title="metrale",
        summary="OpenAI- and Anthropic-compatible LLM server",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.metrale = state

    @app.exception_handler(MetraleError)
    async def _metrale_error(request: Request, exc: MetraleError) -> Response:
        return error_response(exc, anthropic=is_anthropic_path(request.url.path))

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(
            http_error(exc.status_code, message), anthropic=is_anthropic_path(request.url.path)
        )

    @app.get("/health")
    async def health(request: Request) -> Response:
        engine_ = server_state(request).engine
        dead = engine_.dead_error
        if dead is not None or not engine_.is_running:
            return error_response(dead or http_error(503, "the engine is not running"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        return Response(
            server_state(request).metrics.exposition(),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    app.include_router(openai_routes.router)
    app.include_router(completion_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(embeddings_routes.router)
    app.include_router(utility_routes.router)
    app.include_router(lora_routes.router)

    app.add_middleware(_CatchAllMiddleware)
    app.add_middleware(ApiKeyMiddleware, api_key=keys)
    app.add_middleware(_BodyLimitMiddleware, limit=max_body_bytes)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    return app
