"""The server of an M2M100/NLLB checkpoint: translation through `/v1/completions` and
`/v1/chat/completions` with the seed's extension fields.

Owner: server. `metrale serve DIR` builds this app instead of the engine's when `DIR` holds an
encoder-decoder checkpoint (`launch.serve`). Requests go to a `TranslationService`, whose
driver batches every running request's beams in each decoder forward.

Request fields: the text is `prompt` (a string or a list of strings; completions) or the last
user message's text (chat); `src_lang` and `tgt_lang` are language codes of the tokenizer
(default: `--src-lang` / `--tgt-lang` of the deployment); `num_beams` (default 1: greedy),
`length_penalty` (1.0), `early_stopping` (false; true, false or "never"), `max_tokens` (128),
`min_tokens` (0), `no_repeat_ngram_size` (0), `n` (1, at most `num_beams`).

Invariants:
- A language code the tokenizer lacks, a bad field, or `stream: true` is a 400 naming it,
  answered before any work starts.
- A client that disconnects before its translation is done has its requests aborted (their
  blocks freed); `/health` answers while translations run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.request import RequestOutput
from metrale.engine.translate import TranslationService
from metrale.errors import InvalidRequestError, MetraleError
from metrale.model_engine.beam import BeamParams
from metrale.model_engine.beam_backend import check_early_stopping
from metrale.server.auth import ApiKeyMiddleware
from metrale.server.errors import error_response

DEFAULT_MAX_TOKENS = 128
CLIENT_CLOSED_REQUEST = 499
_FIELDS = {
    "num_beams": int,
    "length_penalty": (int, float),
    "max_tokens": int,
    "min_tokens": int,
    "no_repeat_ngram_size": int,
    "n": int,
}


def beam_params(body: dict[str, Any]) -> BeamParams:
    """The request's `BeamParams`; a wrongly typed field is a 400 naming it."""
    for name, kind in _FIELDS.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    early = body.get("early_stopping", False)
    check_early_stopping(early)  # before one beam's forced True could hide a bad value

    def get(name: str, default: Any) -> Any:
        value = body.get(name)
        return default if value is None else value

    num_beams = get("num_beams", 1)
    return BeamParams(
        num_beams=num_beams,
        n=get("n", 1),
        length_penalty=float(get("length_penalty", 1.0)),
        # One beam that stops at its first EOS is greedy decoding, the seed's num_beams=1.
        early_stopping=True if num_beams == 1 else early,
        max_tokens=get("max_tokens", DEFAULT_MAX_TOKENS),
        min_tokens=get("min_tokens", 0),
        no_repeat_ngram_size=get("no_repeat_ngram_size", 0),
    )


def _chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                parts = [
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                ]
                return "".join(parts)
            break
    raise InvalidRequestError(
        "messages holds no user message with text to translate", param="messages"
    )


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def create_translation_app(
    service: TranslationService,
    *,
    model_name: str,
    api_key: str | list[str] | None = None,
) -> FastAPI:
    """The app over `service` (started with the app, shut down after it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="metrale", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(MetraleError)
    async def _metrale_error(request: Request, exc: MetraleError) -> Response:
        return error_response(exc)

    async def _body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequestError("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object")
        if body.get("stream"):
            raise InvalidRequestError(
                "stream is not supported for translation (beam search returns whole hypotheses)",
                param="stream",
            )
        model = body.get("model")
        if model is not None and model != model_name:
            raise InvalidRequestError(
                f"model {model!r} is not served here ({model_name})", param="model"
            )
        return body

    async def _translate(
        request: Request, texts: list[str], body: dict[str, Any]
    ) -> list[RequestOutput] | None:
        """The outputs, or None when the client went away (its requests are aborted)."""
        params = beam_params(body)
        fut = service.submit(texts, body.get("src_lang"), body.get("tgt_lang"), params)
        wrapped = asyncio.wrap_future(fut)
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=0.5)
            if done:
                return wrapped.result()
            if await request.is_disconnected():
                service.cancel(fut)
                return None

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "metrale"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request)
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError(
                "prompt must be a string or a list of strings", param="prompt"
            )
        outputs = await _translate(request, texts, body)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                choices.append({
                    "index": i * len(out.outputs) + c.index, "text": c.text, "logprobs": None,
                    "finish_reason": c.finish_reason, "beam_score": c.cumulative_logprob,
                })  # fmt: skip
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "usage": _usage(outputs),
        })  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _body(request)
        outputs = await _translate(request, [_chat_text(body)], body)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = [
            {
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "logprobs": None,
                "beam_score": c.cumulative_logprob,
            }
            for c in outputs[0].outputs
        ]  # fmt: skip
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "usage": _usage(outputs),
        })  # fmt: skip

    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app
