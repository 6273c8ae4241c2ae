"""OpenAI Responses routes: `POST /v1/responses` (blocking and streaming),
`GET /v1/responses/{id}` and `DELETE /v1/responses/{id}` (stored responses).

Owner: server. The request's conversation (`protocol.responses.conversation`) is rendered by
the chat template and generated as one engine request, like a chat completion.

Invariants:
- The stream is OpenAI's event sequence, every event with its `sequence_number` (0, 1, ...):
  `response.created`, `response.in_progress`, `response.output_item.added`,
  `response.content_part.added`, `response.output_text.delta`s, `response.output_text.done`,
  `response.content_part.done`, `response.output_item.done`, then `response.completed` (or
  `response.incomplete` when `max_output_tokens` ended it). An error after the stream
  started is an `error` event, then the stream ends.
- The deltas concatenate to the final text; the final object equals the blocking answer's
  (ids and timings aside).
- A response is stored (`store`, default true) only once it is complete; a stored response
  can be read back and deleted; its successor sees its turns.
- Leaving early (disconnect, error, shutdown) aborts the engine request.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.handle import RequestStream
from metrale.engine.request import RequestOutput
from metrale.errors import MetraleError
from metrale.server.errors import InternalServerError, error_body
from metrale.server.metrics import RequestTracker
from metrale.server.protocol.responses import (
    ResponsesRequest,
    StoredResponse,
    conversation,
    message_item,
    now,
    response_object,
    usage,
)
from metrale.server.routes.common import open_generation, request_body
from metrale.server.state import ServerState, server_state
from metrale.server.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    sse,
    until_disconnected,
)

router = APIRouter()


class _ResponseJob:
    """One `/v1/responses` request: its engine stream and what it produced so far."""

    def __init__(
        self,
        state: ServerState,
        req: ResponsesRequest,
        stream: RequestStream,
        prompt_tokens: int,
        tracker: RequestTracker,
        turns: list[dict[str, Any]],
    ) -> None:
        self.state = state
        self.req = req
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self.tracker = tracker
        self.turns = turns
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = now()
        self.final: RequestOutput | None = None

    def record(self, output: RequestOutput) -> None:
        self.final = output
        self.tracker.on_tokens(len(output.outputs[0].token_ids))
        if output.error is not None:
            raise InternalServerError(f"generation failed: {output.error}")

    async def run_to_end(self) -> None:
        async for output in self.stream:
            self.record(output)

    def text(self) -> str:
        return self.final.outputs[0].text if self.final is not None else ""

    def usage(self) -> dict[str, Any]:
        out = self.final
        cached = out.num_cached_tokens if out is not None else 0
        generated = len(out.outputs[0].token_ids) if out is not None else 0
        return usage(self.prompt_tokens, cached, generated)

    def object(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        reason = None
        if self.final is not None and self.final.outputs[0].finish_reason == "length":
            status, reason = "incomplete", "max_output_tokens"
        return response_object(
            self.req,
            self.response_id,
            self.state.model_name,
            self.created,
            status=status,
            output=output,
            usage_block=self.usage() if status != "in_progress" else None,
            incomplete_reason=reason,
        )

    def finished_object(self) -> dict[str, Any]:
        body = self.object("completed", [message_item(self.item_id, self.text())])
        if self.req.store:
            turns = [*self.turns, {"role": "assistant", "content": self.text()}]
            self.state.responses.put(self.response_id, StoredResponse(turns, body))
        return body

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


@router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
async def create_response(request: Request) -> Response:
    gen = await open_generation(request, ResponsesRequest)
    state, req = gen.state, gen.body
    messages, turns = conversation(req, state.responses)
    text, ids = await gen.chat_prompt(messages, "input", add_generation_prompt=True)
    params = req.sampling_params(state.sampling_defaults)
    request_id = f"resp-{uuid.uuid4().hex}"
    (stream,) = await gen.add(request_id, [(text, ids)], params, prompt_param="input")
    job = _ResponseJob(state, req, stream, len(ids), gen.tracker, turns)
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
    return JSONResponse(job.finished_object())


async def _events(job: _ResponseJob) -> AsyncIterator[str]:
    sequence = 0

    def event(kind: str, **payload: Any) -> str:
        nonlocal sequence
        frame = sse({"type": kind, "sequence_number": sequence, **payload}, kind)
        sequence += 1
        return frame

    where = {"item_id": job.item_id, "output_index": 0, "content_index": 0}
    sent = 0
    try:
        yield event("response.created", response=job.object("in_progress", []))
        yield event("response.in_progress", response=job.object("in_progress", []))
        item = message_item(job.item_id, "", status="in_progress")
        yield event("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield event("response.content_part.added", **where, part=part)
        async for output in job.stream:
            job.record(output)
            text = output.outputs[0].text
            if len(text) > sent:
                yield event("response.output_text.delta", **where, delta=text[sent:], logprobs=[])
                sent = len(text)
        text = job.text()
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part={**part, "text": text})
        done = message_item(job.item_id, text)
        yield event("response.output_item.done", output_index=0, item=done)
        final = job.finished_object()
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)
    except (MetraleError, Exception) as exc:
        error = error_body(exc)["error"]
        yield event("error", code=error.get("code"), message=error["message"], param=error["param"])
    finally:
        job.close()


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> JSONResponse:
    stored = server_state(request).responses.get(response_id, param="response_id")
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    state = server_state(request)
    state.responses.get(response_id, param="response_id")
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
