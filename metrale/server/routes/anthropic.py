"""Anthropic Messages route: `POST /v1/messages`, blocking and streaming.

Owner: server.

Invariants:
- The stream is Anthropic's event sequence: `message_start` (with usage, sent once the prompt
  is processed so `cache_read_input_tokens` is known), `content_block_start`, `ping`,
  `content_block_delta`s, `content_block_stop`, `message_delta` (stop_reason, stop_sequence,
  usage), `message_stop`. An error after the stream started is an `error` event, then the
  stream ends.
- Errors before the stream are JSON bodies `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.async_engine import RequestStream
from metrale.engine.request import RequestOutput
from metrale.errors import MetraleError
from metrale.server.errors import InternalServerError, error_body
from metrale.server.media import template_messages, vision_inputs
from metrale.server.metrics import RequestTracker
from metrale.server.protocol.anthropic import MessagesRequest, chat_messages, stop_reason, usage
from metrale.server.routes.common import open_generation, request_body
from metrale.server.state import ServerState
from metrale.server.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    sse,
    until_disconnected,
)

router = APIRouter()


class _MessageJob:
    def __init__(
        self,
        state: ServerState,
        message_id: str,
        stream: RequestStream,
        prompt_tokens: int,
        tracker: RequestTracker,
    ) -> None:
        self.state = state
        self.message_id = message_id
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self.tracker = tracker
        self.final: RequestOutput | None = None

    def record(self, output: RequestOutput) -> None:
        self.final = output
        self.tracker.on_tokens(len(output.outputs[0].token_ids))
        if output.error is not None:
            raise InternalServerError(f"generation failed: {output.error}")

    async def run_to_end(self) -> None:
        async for output in self.stream:
            self.record(output)

    def usage(self) -> dict[str, Any]:
        out = self.final
        cached = out.num_cached_tokens if out is not None else 0
        generated = len(out.outputs[0].token_ids) if out is not None else 0
        return usage(self.prompt_tokens, cached, generated)

    def close(self) -> None:
        self.stream.abort()
        out = self.final
        choice = out.outputs[0] if out is not None else None
        self.tracker.finish(
            self.prompt_tokens,
            out.num_cached_tokens if out is not None else 0,
            len(choice.token_ids) if choice is not None else 0,
            [(choice.finish_reason if choice is not None else None) or "abort"],
        )

    def message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_name,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage(),
        }


@router.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
async def create_message(request: Request) -> Response:
    gen = await open_generation(request, MessagesRequest)
    state, req = gen.state, gen.body
    vision = state.engine.info.vision
    messages, images = await template_messages(vision, chat_messages(req))
    text, ids = await gen.chat_prompt(messages, add_generation_prompt=True)
    ids, pictures = await vision_inputs(vision, ids, images)
    message_id = f"msg_{uuid.uuid4().hex}"
    params = req.sampling_params(state.sampling_defaults)
    (stream,) = await gen.add(
        message_id, [(text, ids)], params, prompt_param="messages", vision=pictures
    )
    job = _MessageJob(state, message_id, stream, len(ids), gen.tracker)
    if req.stream:
        return EventStreamResponse(
            _events(job), on_close=job.close, on_disconnect=gen.tracker.client_left
        )
    try:
        await until_disconnected(request, job.run_to_end())
    except ClientDisconnected:
        gen.tracker.client_left()
        raise
    finally:
        job.close()
    assert job.final is not None
    choice = job.final.outputs[0]
    body = job.message([{"type": "text", "text": choice.text}])
    body["stop_reason"], body["stop_sequence"] = stop_reason(choice)
    return JSONResponse(body)


async def _events(job: _MessageJob) -> AsyncIterator[str]:
    sent = 0
    started = False
    try:
        async for output in job.stream:
            job.record(output)
            choice = output.outputs[0]
            if not started:
                started = True
                yield sse({"type": "message_start", "message": job.message([])}, "message_start")
                block = {"type": "text", "text": ""}
                start = {"type": "content_block_start", "index": 0, "content_block": block}
                yield sse(start, "content_block_start")
                yield sse({"type": "ping"}, "ping")
            delta = choice.text[sent:]
            if delta:
                sent = len(choice.text)
                event = {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": delta},
                }
                yield sse(event, "content_block_delta")
            if choice.finished:
                reason, sequence = stop_reason(choice)
                yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                message_delta = {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": job.usage(),
                }
                yield sse(message_delta, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except (MetraleError, Exception) as exc:
        yield sse(error_body(exc, anthropic=True), "error")
    finally:
        job.close()
