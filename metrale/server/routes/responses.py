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
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.handle import RequestStream
from metrale.engine.request import RequestOutput
from metrale.errors import MetraleError
from metrale.server.chat_output import ChatOutputPlan, ChoiceParts, responses_plan
from metrale.server.errors import InternalServerError, error_body
from metrale.server.metrics import RequestTracker
from metrale.server.protocol.responses import (
    ResponsesRequest,
    StoredResponse,
    conversation,
    message_item,
    now,
    reasoning_item,
    response_object,
    usage,
)
from metrale.server.routes.common import open_generation, request_body
from metrale.server.state import ServerState, server_state
from metrale.server.streaming import (
    sse,
)
from metrale.server.tools import ToolCall, responses_function_item

router = APIRouter()


@dataclass(eq=False)
class _ResponseJob:
    """One `/v1/responses` request: its engine stream and what it produced so far."""

    state: ServerState
    req: ResponsesRequest
    stream: RequestStream
    prompt_tokens: int
    tracker: RequestTracker
    turns: list[dict[str, Any]]
    plan: ChatOutputPlan
    prompt: str
    response_id: str = field(init=False, default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    item_id: str = field(init=False, default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = field(init=False, default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    #: Tokens of the reasoning split off the answer (`usage.output_tokens_details`).
    reasoning_tokens: int = field(init=False, default=0)
    created: int = field(init=False, default_factory=now)
    final: RequestOutput | None = field(init=False, default=None)

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
        return usage(self.prompt_tokens, cached, generated, self.reasoning_tokens)

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

    def parts(self) -> ChoiceParts:
        """The answer split by the plan: content and tool calls."""
        return self.plan.parts(self.text(), self.prompt)

    def output_items(self, parts: ChoiceParts) -> list[dict[str, Any]]:
        """The reasoning (when the plan split some off), the message (when there is text, or
        nothing else), then one `function_call` item per tool call: the order the stream
        announces them in."""
        items = [reasoning_item(self.reasoning_id, parts.reasoning)] if parts.reasoning else []
        if parts.content or not parts.tool_calls:
            items.append(message_item(self.item_id, parts.content))
        return items + [responses_function_item(call) for call in parts.tool_calls]

    def finished_object(self, parts: ChoiceParts | None = None) -> dict[str, Any]:
        parts = parts if parts is not None else self.parts()
        if parts.reasoning:
            tokenizer = self.state.tokenizer
            self.reasoning_tokens = len(tokenizer.encode(parts.reasoning, add_special_tokens=False))
        body = self.object("completed", self.output_items(parts))
        if self.req.store:
            turn: dict[str, Any] = {"role": "assistant", "content": parts.content}
            if parts.tool_calls:
                turn["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.input},
                    }
                    for call in parts.tool_calls
                ]
            turns = [*self.turns, turn]
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
    plan = responses_plan(req, state.tokenizer, state.tool_call_parser, state.reasoning_parser)
    messages, turns = conversation(req, state.responses)
    text, ids = await gen.chat_prompt(
        messages, "input", add_generation_prompt=True, **plan.template_args()
    )
    params = plan.apply(req.sampling_params(state.sampling_defaults))
    request_id = f"resp-{uuid.uuid4().hex}"
    (stream,) = await gen.add(request_id, [(text, ids)], params, prompt_param="input")
    job = _ResponseJob(state, req, stream, len(ids), gen.tracker, turns, plan, text)
    if req.stream:
        return gen.stream(_events(job), job.close)
    await gen.wait(job.run_to_end(), job.close)
    return JSONResponse(job.finished_object())


async def _events(job: _ResponseJob) -> AsyncIterator[str]:
    sequence = 0

    def event(kind: str, **payload: Any) -> str:
        nonlocal sequence
        frame = sse({"type": kind, "sequence_number": sequence, **payload}, kind)
        sequence += 1
        return frame

    where = {"item_id": job.item_id, "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    splitter = job.plan.splitter(job.prompt)
    content = ""
    reasoning = ""
    base = 0  # output items before the message: 1 once a reasoning item was sent
    opened = False  # the message item (index `base`), opened at its first text
    calls: list[ToolCall] = []

    def flush_reasoning() -> list[str]:
        """The reasoning item, whole, once the answer starts (reasoning comes first)."""
        nonlocal base
        if not reasoning or base:
            return []
        base = 1
        where["output_index"] = 1
        item = reasoning_item(job.reasoning_id, reasoning)
        at = {"item_id": job.reasoning_id, "output_index": 0, "content_index": 0}
        return [
            event("response.output_item.added", output_index=0,
                  item={**item, "content": [], "status": "in_progress"}),
            event("response.reasoning_text.delta", **at, delta=reasoning),
            event("response.reasoning_text.done", **at, text=reasoning),
            event("response.output_item.done", output_index=0, item=item),
        ]  # fmt: skip

    def open_message() -> list[str]:
        nonlocal opened
        opened = True
        item = message_item(job.item_id, "", status="in_progress")
        return [
            *flush_reasoning(),
            event("response.output_item.added", output_index=where["output_index"], item=item),
            event("response.content_part.added", **where, part=part),
        ]

    def close_message() -> list[str]:
        done = message_item(job.item_id, content)
        return [
            event("response.output_text.done", **where, text=content, logprobs=[]),
            event("response.content_part.done", **where, part={**part, "text": content}),
            event("response.output_item.done", output_index=where["output_index"], item=done),
        ]

    try:
        yield event("response.created", response=job.object("in_progress", []))
        yield event("response.in_progress", response=job.object("in_progress", []))
        async for output in job.stream:
            job.record(output)
            choice = output.outputs[0]
            parts = splitter.feed(choice.text, final=choice.finished)
            reasoning += parts.reasoning or ""
            frames: list[str] = []
            if parts.content:
                if not opened:
                    frames += open_message()
                content += parts.content
                frames.append(
                    event("response.output_text.delta", **where, delta=parts.content, logprobs=[])
                )
            for call in parts.tool_calls:
                if not calls and opened:
                    frames += close_message()
                frames += flush_reasoning()
                index = base + len(calls) + (1 if opened else 0)
                calls.append(call)
                item = responses_function_item(call, status="in_progress")
                at = {"item_id": item["id"], "output_index": index}
                frames += [
                    event("response.output_item.added", output_index=index,
                          item={**item, "arguments": ""}),
                    event("response.function_call_arguments.delta", **at, delta=call.arguments),
                    event("response.function_call_arguments.done", **at,
                          arguments=call.arguments),
                    event("response.output_item.done", output_index=index,
                          item=responses_function_item(call)),
                ]  # fmt: skip
            for frame in frames:
                yield frame
        if not calls:
            if not opened:
                for frame in open_message():
                    yield frame
            for frame in close_message():
                yield frame
        final = job.finished_object(ChoiceParts(reasoning or None, content, calls))
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
