"""Anthropic Messages route: `POST /v1/messages`, blocking and streaming.

Owner: server.

Invariants:
- The stream is Anthropic's event sequence: `message_start` (with usage, sent once the prompt
  is processed so `cache_read_input_tokens` is known), `content_block_start`, `ping`,
  `content_block_delta`s, `content_block_stop`, `message_delta` (stop_reason, stop_sequence,
  usage), `message_stop`. An error after the stream started is an `error` event, then the
  stream ends.
- Errors before the stream are JSON bodies `{"type": "error", "error": {...}}`.
- Content blocks: `thinking` (the reasoning), `text`, then one `tool_use` per tool call, in
  that order, streamed as `thinking_delta`, `text_delta` and one `input_json_delta` per call;
  `stop_reason` "tool_use" when the answer called tools.
- `thinking.budget_tokens` is enforced: the reasoning phase generates at most that many
  tokens (the prompt opened with `<think>`, stopping at `</think>`), then the answer phase
  continues from the prompt plus the reasoning and a closing `</think>`, with what is left of
  `max_tokens`; `usage.output_tokens` counts both.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.async_engine import RequestStream
from metrale.engine.request import RequestOutput
from metrale.errors import MetraleError
from metrale.sampling.params import SamplingParams
from metrale.server.chat_output import ChatOutputPlan, ChoiceSplitter, anthropic_plan
from metrale.server.errors import InternalServerError, error_body
from metrale.server.media import template_messages, vision_inputs
from metrale.server.protocol.anthropic import MessagesRequest, chat_messages, stop_reason, usage
from metrale.server.protocol.common import unsupported
from metrale.server.reasoning import THINK_END, THINK_START
from metrale.server.routes.common import Generation, open_generation, request_body
from metrale.server.streaming import (
    sse,
)
from metrale.server.tools import ToolCall

router = APIRouter()


class _MessageJob:
    """One Messages request: its phases (with an enabled `thinking` budget, the reasoning
    phase of at most `budget_tokens` tokens ending at `</think>`, then the answer phase from
    the prompt plus that reasoning and a closing `</think>`), their outputs, its usage."""

    def __init__(
        self,
        gen: Generation[MessagesRequest],
        message_id: str,
        prompt: str,
        ids: list[int],
        params: SamplingParams,
        plan: ChatOutputPlan,
        vision: Any = None,
    ) -> None:
        self.gen = gen
        #: The prompt's images (`VisionInputs`), with the first phase's ids; None for text.
        self.vision = vision
        self.state = gen.state
        self.message_id = message_id
        self.prompt = prompt
        self.prompt_tokens = len(ids)
        self.tracker = gen.tracker
        self.params = params
        self.plan = plan
        self.budget = plan.thinking_budget
        self.ids = ids
        self.stream: RequestStream | None = None
        #: The reasoning phase's final output (budgeted thinking), then the answer's.
        self.thinking: RequestOutput | None = None
        self.final: RequestOutput | None = None
        #: The `model` the answer names: the served model, or the LoRA adapter asked for.
        self.model = gen.model_name
        self.cached = 0

    async def start(self) -> None:
        """Queue the first phase (refusals surface here, before any response byte)."""
        if self.budget is None:
            self.stream = await self._add(
                self.message_id, self.prompt, self.ids, self.params, self.vision
            )
            return
        if self.vision is not None:
            raise unsupported("thinking", "a thinking budget with images is not implemented")
        prompt = self.prompt
        if not prompt.rstrip().endswith(THINK_START):
            prompt += THINK_START + "\n"
        self.prompt = prompt
        ids = await asyncio.to_thread(self.state.tokenizer.encode, prompt, False)
        params = self.params.replace(
            max_tokens=self.budget, stop=[THINK_END], structured_outputs=None
        )
        self.stream = await self._add(f"{self.message_id}-think", prompt, ids, params)

    async def _add(
        self, rid: str, prompt: str, ids: list[int], params: SamplingParams, vision: Any = None
    ) -> RequestStream:
        (stream,) = await self.gen.add(
            rid, [(prompt, ids)], params, prompt_param="messages", vision=vision
        )
        return stream

    async def phases(self) -> AsyncIterator[tuple[str, RequestOutput]]:
        """("thinking" | "answer", output) for every output of every phase, in order."""
        assert self.stream is not None
        phase = "answer" if self.budget is None else "thinking"
        async for output in self.stream:
            self.record(output)
            yield phase, output
        if phase == "answer":
            return
        thinking = self.thinking = self.final
        self.final = None
        assert thinking is not None
        choice = thinking.outputs[0]
        self.cached = thinking.num_cached_tokens
        if choice.finish_reason == "stop" and choice.stop_reason is None:
            return  # the model ended its turn while thinking: no answer
        prompt = self.prompt + choice.text + "\n" + THINK_END + "\n\n"
        ids = await asyncio.to_thread(self.state.tokenizer.encode, prompt, False)
        left = self.params.max_tokens - len(choice.token_ids)  # type: ignore[operator]
        self.stream = await self._add(
            f"{self.message_id}-answer", prompt, ids, self.params.replace(max_tokens=left)
        )
        async for output in self.stream:
            self.record(output)
            yield "answer", output

    def record(self, output: RequestOutput) -> None:
        self.final = output
        self.tracker.on_tokens(self.output_tokens())
        if output.error is not None:
            raise InternalServerError(f"generation failed: {output.error}")

    def output_tokens(self) -> int:
        return sum(
            len(out.outputs[0].token_ids) for out in (self.thinking, self.final) if out is not None
        )

    def usage(self) -> dict[str, Any]:
        cached = self.final.num_cached_tokens if self.final is not None else self.cached
        if self.thinking is not None:
            cached = self.thinking.num_cached_tokens
        return usage(self.prompt_tokens, cached, self.output_tokens())

    def close(self) -> None:
        if self.stream is not None:
            self.stream.abort()
        out = self.final or self.thinking
        choice = out.outputs[0] if out is not None else None
        self.tracker.finish(
            self.prompt_tokens,
            out.num_cached_tokens if out is not None else 0,
            self.output_tokens(),
            [(choice.finish_reason if choice is not None else None) or "abort"],
        )

    def message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage(),
        }

    def stop(self, called: bool) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) once done: "tool_use" when the answer called tools."""
        out = self.final or self.thinking
        assert out is not None
        reason, sequence = stop_reason(out.outputs[0])
        if self.final is None and out is self.thinking and reason == "stop_sequence":
            reason, sequence = "end_turn", None  # the thinking phase's own </think> stop
        if called and reason == "end_turn":
            reason = "tool_use"
        return reason, sequence


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{call.id[5:]}",
        "name": call.name,
        "input": call.input,
    }


@router.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
async def create_message(request: Request) -> Response:
    gen = await open_generation(request, MessagesRequest)
    state, req = gen.state, gen.body
    plan = anthropic_plan(req, state.tokenizer, state.tool_call_parser, state.reasoning_parser)
    vision = state.engine.info.vision
    messages, images = await template_messages(vision, chat_messages(req))
    text, ids = await gen.chat_prompt(messages, add_generation_prompt=True, **plan.template_args())
    ids, pictures = await vision_inputs(vision, ids, images)
    message_id = f"msg_{uuid.uuid4().hex}"
    params = plan.apply(req.sampling_params(state.sampling_defaults))
    job = _MessageJob(gen, message_id, text, ids, params, plan, pictures)
    await job.start()
    if req.stream:
        return gen.stream(_events(job), job.close)
    await gen.wait(_drain(job), job.close)
    content: list[dict[str, Any]] = []
    answer_plan = plan.answer_plan()
    reasoning: str | None = None
    if job.thinking is not None:
        reasoning = job.thinking.outputs[0].text
    calls: list[ToolCall] = []
    answer = ""
    if job.final is not None:
        parts = answer_plan.parts(job.final.outputs[0].text, job.prompt)
        reasoning = parts.reasoning if reasoning is None else reasoning
        answer, calls = parts.content, parts.tool_calls
    if reasoning is not None:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if answer or not (calls or content):
        content.append({"type": "text", "text": answer})
    content += [_tool_use(call) for call in calls]
    body = job.message(content)
    body["stop_reason"], body["stop_sequence"] = job.stop(bool(calls))
    return JSONResponse(body)


async def _drain(job: _MessageJob) -> None:
    async for _ in job.phases():
        pass


class _Blocks:
    """The stream's content blocks: one open at a time, numbered from 0."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def open(self, kind: str, block: dict[str, Any]) -> list[str]:
        frames = self.close()
        self.index += 1
        self.kind = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        frames.append(sse(start, "content_block_start"))
        if self.index == 0:  # Anthropic's order: the first block's start, then a ping
            frames.append(sse({"type": "ping"}, "ping"))
        return frames

    def delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        frames = [] if self.kind == kind else self.open(kind, block)
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return [*frames, sse(event, "content_block_delta")]


async def _events(job: _MessageJob) -> AsyncIterator[str]:
    started = False
    blocks = _Blocks()
    answer_plan = job.plan.answer_plan()
    splitter: ChoiceSplitter | None = None
    thinking_sent = 0
    called = False
    try:
        async for phase, output in job.phases():
            choice = output.outputs[0]
            if not started:
                started = True
                yield sse({"type": "message_start", "message": job.message([])}, "message_start")
            frames: list[str] = []
            if phase == "thinking":
                delta = choice.text[thinking_sent:]
                thinking_sent = len(choice.text)
                if delta or blocks.kind is None:
                    frames += blocks.delta(
                        "thinking",
                        {"type": "thinking", "thinking": "", "signature": ""},
                        {"type": "thinking_delta", "thinking": delta},
                    )
            else:
                if splitter is None:
                    splitter = answer_plan.splitter(job.prompt)
                parts = splitter.feed(choice.text, final=choice.finished)
                if parts.reasoning:
                    frames += blocks.delta(
                        "thinking",
                        {"type": "thinking", "thinking": "", "signature": ""},
                        {"type": "thinking_delta", "thinking": parts.reasoning},
                    )
                if parts.content:
                    frames += blocks.delta(
                        "text",
                        {"type": "text", "text": ""},
                        {"type": "text_delta", "text": parts.content},
                    )
                for call in parts.tool_calls:
                    called = True
                    use = _tool_use(call)
                    frames += blocks.open("tool_use", {**use, "input": {}})
                    frames += blocks.delta(
                        "tool_use",
                        use,
                        {"type": "input_json_delta", "partial_json": call.arguments},
                    )
            for frame in frames:
                yield frame
        if blocks.index < 0:  # nothing was generated: one empty text block
            for frame in blocks.open("text", {"type": "text", "text": ""}):
                yield frame
        for frame in blocks.close():
            yield frame
        reason, sequence = job.stop(called)
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
