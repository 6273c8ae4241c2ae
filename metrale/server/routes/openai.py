"""OpenAI routes: `/v1/models` (the base model, then each LoRA adapter with `parent` the
base), `/v1/completions`, `/v1/chat/completions`.

Owner: server. Each handler parses and validates the body, tokenizes (chat template for chat),
hands one engine request per prompt to `AsyncEngine`, and answers with one JSON body or an SSE
stream of chunks ending in `data: [DONE]`.

Invariants:
- Validation errors surface before any response byte is sent (4xx JSON); an error after a
  stream started becomes an OpenAI error frame, then `[DONE]`.
- Streamed text deltas concatenate to exactly the non-streamed text (engine outputs are
  cumulative and their text only grows).
- Choice indices: completions with several prompts number choices `prompt_index * n + i`.
- `usage` is on every JSON response; in a stream it is on a final `choices: []` chunk with
  `stream_options.include_usage`, otherwise on the last choice chunk.
- Leaving early (disconnect, error, shutdown) aborts every engine request of the HTTP request.
- Every engine request gets the body's `speculative` and the draft-lookup tenant of the
  request's API key and `tenant` field (`request_tenant`).
- A chat request's tools, tool choice, reasoning split and output constraint are its
  `ChatOutputPlan` (`metrale.server.chat_output`): the template gets the tools, the sampling
  the grammar, and each choice's text is split into `reasoning_content`, `content` and
  `tool_calls` (finish reason "tool_calls" when it called one); streamed, the deltas of each
  concatenate to the non-streamed parts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.async_engine import RequestStream
from metrale.engine.request import CompletionOutput, RequestOutput
from metrale.errors import MetraleError, NotFoundError
from metrale.server.chat_output import ChatOutputPlan, openai_plan
from metrale.server.errors import InternalServerError, error_body, safe_text
from metrale.server.media import template_messages, vision_inputs
from metrale.server.metrics import RequestTracker
from metrale.server.protocol.common import unsupported
from metrale.server.protocol.openai import (
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    chat_logprobs_content,
    chat_messages,
    finish_reason,
    merge_completion_logprobs,
    prompt_logprobs_json,
    usage,
)
from metrale.server.routes.common import open_generation, request_body
from metrale.server.state import ServerState, server_state
from metrale.server.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    merge_streams,
    sse,
    until_disconnected,
)
from metrale.tokenizer.fim import fim_prompt

SYSTEM_FINGERPRINT = "fp_metrale"

router = APIRouter()


# ----------------------------------------------------------------------------- models


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "metrale",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
    }


def _adapter_card(state: ServerState, name: str) -> dict[str, Any]:
    """A LoRA adapter's card: vLLM's shape (`root` its directory, `parent` the base)."""
    adapter = (state.loras or {})[name]
    return {
        **_model_card(state, name), "root": adapter.path, "parent": state.model_name,
    }  # fmt: skip


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = server_state(request)
    names = (state.model_name, *state.model_aliases)
    cards = [
        *(_model_card(state, n) for n in names),
        *(_adapter_card(state, n) for n in state.loras or {}),
    ]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    state = server_state(request)
    if model_id in (state.loras or {}) and model_id != state.model_name:
        return JSONResponse(_adapter_card(state, model_id))
    if model_id != state.model_name and model_id not in state.model_aliases:
        raise NotFoundError(f"the model '{safe_text(model_id, 256)}' does not exist", param="model")
    return JSONResponse(_model_card(state, model_id))


# ------------------------------------------------------------------ shared machinery


@dataclass
class _Job:
    """One HTTP generation request: its engine streams and what has been produced so far."""

    state: ServerState
    request_id: str
    streams: list[RequestStream]
    prompts: Sequence[tuple[str | None, list[int]]]
    n: int
    tracker: RequestTracker
    created: int = field(default_factory=lambda: int(time.time()))
    finals: list[RequestOutput | None] = field(default_factory=list)
    #: The `model` the answer names: the served model, or the LoRA adapter asked for.
    model: str = ""

    def __post_init__(self) -> None:
        self.finals = [None] * len(self.streams)

    def record(self, index: int, output: RequestOutput) -> None:
        self.finals[index] = output
        self.tracker.on_tokens(self.completion_tokens())
        if output.error is not None:
            raise InternalServerError(f"generation failed: {output.error}")

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.finals if o is not None for c in o.outputs)

    def all_finished(self) -> bool:
        return all(o is not None and o.finished for o in self.finals)

    def usage(self, count_completion: bool = True) -> dict[str, Any]:
        return usage(
            sum(len(ids) for _, ids in self.prompts),
            self.completion_tokens() if count_completion else 0,
            sum(o.num_cached_tokens for o in self.finals if o is not None),
        )

    async def run_to_end(self) -> None:
        merged = merge_streams(self.streams)
        try:
            async for index, output in merged:
                self.record(index, output)
        finally:
            await merged.aclose()

    def close(self) -> None:
        """Abort what is still running and account the request in the metrics (idempotent)."""
        for stream in self.streams:
            stream.abort()
        reasons = []
        for output in self.finals:
            choices = output.outputs if output is not None else []
            reasons += [c.finish_reason or "abort" for c in choices]
            reasons += ["abort"] * (self.n - len(choices))
        self.tracker.finish(
            sum(len(ids) for _, ids in self.prompts),
            sum(o.num_cached_tokens for o in self.finals if o is not None),
            self.completion_tokens(),
            reasons,
        )

    def choices(self) -> list[tuple[int, int, RequestOutput, CompletionOutput]]:
        """(choice index, prompt index, request output, choice) of every finished choice."""
        result = []
        for p, output in enumerate(self.finals):
            assert output is not None
            for choice in output.outputs:
                result.append((p * self.n + choice.index, p, output, choice))
        return result


async def _error_frames(exc: BaseException) -> AsyncIterator[str]:
    yield sse(error_body(exc))
    yield sse("[DONE]")


Outputs = AsyncIterator[tuple[int, RequestOutput]]


async def _event_stream(
    job: _Job,
    frames: Callable[[Outputs], AsyncIterator[str]],
    usage_chunk: Callable[[], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """A streaming response: the frames `frames` makes of the job's merged outputs, then the
    usage chunk when the request asks for one, then `[DONE]`; on any error an error frame and
    `[DONE]` instead of the rest. The merged streams and the job close however it ends."""
    merged = merge_streams(job.streams)
    body = frames(merged)
    try:
        async for frame in body:
            yield frame
        if usage_chunk is not None:
            yield sse(usage_chunk())
        yield sse("[DONE]")
    except (MetraleError, Exception) as exc:
        async for frame in _error_frames(exc):
            yield frame
    finally:
        await body.aclose()
        await merged.aclose()
        job.close()


async def _collect(request: Request, job: _Job) -> None:
    try:
        await until_disconnected(request, job.run_to_end())
    except ClientDisconnected:
        job.tracker.client_left()
        raise
    finally:
        job.close()


# ------------------------------------------------------------------------ completions


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def create_completion(request: Request) -> Response:
    gen = await open_generation(request, CompletionRequest)
    state, req = gen.state, gen.body
    prompt = req.prompt
    if req.suffix:  # fill-in-the-middle, in the model's own FIM layout
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompt = [fim_prompt(state.tokenizer, p, req.suffix) for p in texts]
    prompts = await gen.completion_prompts(
        prompt,
        add_special_tokens=req.add_special_tokens is not False,
        truncate=req.truncate if req.truncate_prompt_tokens is not None else None,
    )
    echo = bool(req.echo)
    echo_only = echo and req.max_tokens == 0
    params = req.sampling_params(
        max_tokens=1 if echo_only else req.max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs
        if req.prompt_logprobs is not None
        else (req.logprobs if echo else None),
        defaults=state.sampling_defaults,
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await gen.add(request_id, prompts, params)
    job = _Job(state, request_id, streams, prompts, params.n, gen.tracker, model=gen.model_name)
    view = _CompletionView(job, req, echo, echo_only)
    if req.stream:
        return EventStreamResponse(
            view.events(), on_close=job.close, on_disconnect=gen.tracker.client_left
        )
    await _collect(request, job)
    return JSONResponse(view.response())


class _CompletionView:
    """Renders a completions job as one JSON body or as SSE chunks."""

    def __init__(self, job: _Job, req: CompletionRequest, echo: bool, echo_only: bool) -> None:
        self.job = job
        self.req = req
        self.echo = echo
        self.echo_only = echo_only
        self.tokenizer = job.state.tokenizer

    def _prompt_text(self, prompt: int) -> str:
        text, ids = self.job.prompts[prompt]
        return text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprobs(self) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        return CompletionLogprobs(
            self.tokenizer, self.req.logprobs, as_ids=bool(self.req.return_tokens_as_token_ids)
        )

    def _extras(self, prompt: int, output: RequestOutput, first: bool) -> dict[str, Any]:
        """vLLM's extension fields of a choice (or of its first chunk): `prompt_logprobs`,
        `prompt_token_ids` (with `return_token_ids`)."""
        extras: dict[str, Any] = {}
        if first and self.req.prompt_logprobs is not None:
            extras["prompt_logprobs"] = prompt_logprobs_json(
                self.tokenizer, output.prompt_logprobs, bool(self.req.return_tokens_as_token_ids)
            )
        if first and self.req.return_token_ids:
            extras["prompt_token_ids"] = self.job.prompts[prompt][1]
        return extras

    def _echo_block(self, builder: CompletionLogprobs, prompt: int, output: RequestOutput) -> Any:
        ids = self.job.prompts[prompt][1]
        scored = output.prompt_logprobs or [None] * len(ids)
        return builder.block(ids, scored)

    def _finish(self, choice: CompletionOutput) -> str | None:
        if choice.finish_reason is None:
            return None
        return "length" if self.echo_only else finish_reason(choice.finish_reason)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.job.request_id,
            "object": "text_completion",
            "created": self.job.created,
            "model": self.job.model or self.job.state.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }

    def response(self) -> dict[str, Any]:
        choices = []
        for index, prompt, output, choice in self.job.choices():
            text = self._prompt_text(prompt) if self.echo else ""
            builder = self._logprobs()
            block = None
            if builder is not None:
                if self.echo:
                    block = self._echo_block(builder, prompt, output)
                if not self.echo_only:
                    generated = builder.block(choice.token_ids, choice.logprobs or [])
                    block = (
                        generated if block is None else merge_completion_logprobs(block, generated)
                    )
            if not self.echo_only:
                text += choice.text
            entry = {
                "index": index,
                "text": text,
                "logprobs": block,
                "finish_reason": self._finish(choice),
                **self._extras(prompt, output, first=True),
            }
            if self.req.return_token_ids:
                entry["token_ids"] = [] if self.echo_only else choice.token_ids
            choices.append(entry)
        choices.sort(key=lambda c: c["index"])
        body = self._envelope(choices)
        body["usage"] = self.job.usage(count_completion=not self.echo_only)
        return body

    def events(self) -> AsyncIterator[str]:
        usage = self._usage_chunk if self.req.include_usage else None
        return _event_stream(self.job, self._frames, usage)

    def _usage_chunk(self) -> dict[str, Any]:
        final = self._envelope([])
        final["usage"] = self.job.usage(count_completion=not self.echo_only)
        return final

    async def _frames(self, merged: Outputs) -> AsyncIterator[str]:
        job = self.job
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        builders: dict[int, CompletionLogprobs | None] = {}
        done: set[int] = set()
        async for prompt, output in merged:
            job.record(prompt, output)
            for choice in output.outputs:
                index = prompt * job.n + choice.index
                if index in done:
                    continue
                first = index not in builders
                if first:
                    builders[index] = self._logprobs()
                builder = builders[index]
                text = self._prompt_text(prompt) if first and self.echo else ""
                block = (
                    self._echo_block(builder, prompt, output)
                    if first and self.echo and builder is not None
                    else None
                )
                if not self.echo_only:
                    start_t, start_k = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    text += choice.text[start_t:]
                    if builder is not None and (text or choice.finished):
                        new = builder.block(
                            choice.token_ids[start_k:], (choice.logprobs or [])[start_k:]
                        )
                        block = new if block is None else merge_completion_logprobs(block, new)
                reason = self._finish(choice)
                if not text and reason is None:
                    continue  # nothing visible yet (held back for a possible stop string)
                entry = {"index": index, "text": text, "logprobs": block, "finish_reason": reason}
                entry.update(self._extras(prompt, output, index not in sent_text))
                if self.req.return_token_ids:
                    start_k = sent_tokens.get(index, 0)
                    entry["token_ids"] = [] if self.echo_only else choice.token_ids[start_k:]
                sent_text[index] = len(choice.text)
                sent_tokens[index] = len(choice.token_ids)
                chunk = self._envelope([entry])
                if reason is not None:
                    done.add(index)
                    last = job.all_finished() and len(done) == len(job.finals) * job.n
                    if last and not self.req.include_usage:
                        chunk["usage"] = job.usage(count_completion=not self.echo_only)
                yield sse(chunk)


# ------------------------------------------------------------------- chat completions


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    gen = await open_generation(request, ChatCompletionRequest)
    state, req = gen.state, gen.body
    plan = openai_plan(req, state.tokenizer, state.tool_call_parser, state.reasoning_parser)
    messages = chat_messages(req.messages)
    template: dict[str, Any] = {**plan.template_args(), **(req.chat_template_kwargs or {})}
    if req.chat_template is not None:
        template["chat_template"] = req.chat_template
    vision = state.engine.info.vision
    rendered, images = await template_messages(vision, messages)
    if images and req.truncate_prompt_tokens is not None:
        raise unsupported("truncate_prompt_tokens", "truncating a prompt with images")
    text, ids = await gen.chat_prompt(
        rendered,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        add_special_tokens=bool(req.add_special_tokens),
        truncate=req.truncate if req.truncate_prompt_tokens is not None else None,
        **template,
    )
    params = plan.apply(
        req.sampling_params(
            max_tokens=req.resolved_max_tokens,
            logprobs=req.logprob_count,
            prompt_logprobs=req.prompt_logprobs,
            defaults=state.sampling_defaults,
        )
    )
    ids, pictures = await vision_inputs(vision, ids, images)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await gen.add(
        request_id, [(text, ids)], params, prompt_param="messages", vision=pictures
    )
    job = _Job(
        state, request_id, streams, [(text, ids)], params.n, gen.tracker, model=gen.model_name
    )
    # vLLM's `echo`: the answer starts with the final message when it is the assistant's.
    last = messages[-1]
    echoed = last["content"] if req.echo and last["role"] == "assistant" else ""
    echoed = echoed if isinstance(echoed, str) else ""
    view = _ChatView(job, req, plan, text, echoed)
    if req.stream:
        return EventStreamResponse(
            view.events(), on_close=job.close, on_disconnect=gen.tracker.client_left
        )
    await _collect(request, job)
    return JSONResponse(view.response())


class _ChatView:
    def __init__(
        self,
        job: _Job,
        req: ChatCompletionRequest,
        plan: ChatOutputPlan,
        prompt: str,
        echoed: str = "",
    ) -> None:
        self.job = job
        self.req = req
        self.plan = plan
        self.prompt = prompt
        self.echoed = echoed
        self.tokenizer = job.state.tokenizer
        self.top = req.top_logprobs or 0
        self.as_ids = bool(req.return_tokens_as_token_ids)

    def _logprobs(self, choice: CompletionOutput, start: int = 0) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return {
            "content": chat_logprobs_content(
                self.tokenizer,
                choice.token_ids[start:],
                (choice.logprobs or [])[start:],
                self.top,
                self.as_ids,
            ),
            "refusal": None,
        }

    def _extras(self) -> dict[str, Any]:
        """vLLM's extension fields of the answer (or of the first chunk)."""
        extras: dict[str, Any] = {}
        if self.req.prompt_logprobs is not None:
            final = self.job.finals[0]
            positions = final.prompt_logprobs if final is not None else None
            extras["prompt_logprobs"] = prompt_logprobs_json(self.tokenizer, positions, self.as_ids)
        if self.req.return_token_ids:
            extras["prompt_token_ids"] = self.job.prompts[0][1]
        return extras

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.job.request_id,
            "object": obj,
            "created": self.job.created,
            "model": self.job.model or self.job.state.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }

    def _message(self, choice: CompletionOutput) -> tuple[dict[str, Any], bool]:
        """The choice's message (reasoning, content and tool calls split by the plan) and
        whether it called tools."""
        parts = self.plan.parts(choice.text, self.prompt)
        content = self.echoed + parts.content
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not parts.tool_calls else None,
            "refusal": None,
        }
        if self.plan.reasoning is not None:
            message["reasoning_content"] = parts.reasoning
        if parts.tool_calls:
            message["tool_calls"] = [call.openai() for call in parts.tool_calls]
        return message, bool(parts.tool_calls)

    def _finish_reason(self, choice: CompletionOutput, called: bool) -> str | None:
        reason = finish_reason(choice.finish_reason)
        return "tool_calls" if called and reason == "stop" else reason

    def response(self) -> dict[str, Any]:
        choices = []
        for index, _, _, choice in self.job.choices():
            message, called = self._message(choice)
            entry = {
                "index": index,
                "message": message,
                "logprobs": self._logprobs(choice),
                "finish_reason": self._finish_reason(choice, called),
            }
            if self.req.return_token_ids:
                entry["token_ids"] = choice.token_ids
            choices.append(entry)
        body = self._envelope("chat.completion", choices)
        body["usage"] = self.job.usage()
        body.update(self._extras())
        return body

    def _chunk(self, index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        return self._envelope("chat.completion.chunk", [choice])

    def events(self) -> AsyncIterator[str]:
        usage = self._usage_chunk if self.req.include_usage else None
        return _event_stream(self.job, self._frames, usage)

    def _usage_chunk(self) -> dict[str, Any]:
        final = self._envelope("chat.completion.chunk", [])
        final["usage"] = self.job.usage()
        return final

    async def _frames(self, merged: Outputs) -> AsyncIterator[str]:
        job = self.job
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        splitters = {index: self.plan.splitter(self.prompt) for index in range(job.n)}
        calls: dict[int, int] = {}  # tool calls sent per choice
        for index in range(job.n):
            chunk = self._chunk(index, {"role": "assistant", "content": self.echoed})
            if index == 0 and self.req.return_token_ids:
                chunk["prompt_token_ids"] = job.prompts[0][1]
            yield sse(chunk)
        scored = self.req.prompt_logprobs is None
        async for prompt, output in merged:
            job.record(prompt, output)
            if not scored:  # the prompt's logprobs, once the prompt is processed
                scored = True
                chunk = self._chunk(0, {})
                chunk["prompt_logprobs"] = self._extras()["prompt_logprobs"]
                yield sse(chunk)
            for choice in output.outputs:
                index = choice.index
                if index in done:
                    continue
                start_k = sent_tokens.get(index, 0)
                parts = splitters[index].feed(choice.text, final=choice.finished)
                deltas: list[dict[str, Any]] = []
                if parts.reasoning:
                    deltas.append({"reasoning_content": parts.reasoning})
                if parts.content:
                    deltas.append({"content": parts.content})
                for call in parts.tool_calls:
                    deltas.append({"tool_calls": [call.openai(calls.get(index, 0))]})
                    calls[index] = calls.get(index, 0) + 1
                for delta in deltas:
                    more: dict[str, Any] = {"logprobs": self._logprobs(choice, start_k)}
                    if self.req.return_token_ids:
                        more["token_ids"] = choice.token_ids[start_k:]
                    sent_tokens[index] = start_k = len(choice.token_ids)
                    yield sse(self._chunk(index, delta, **more))
                if choice.finished:
                    done.add(index)
                    extra: dict[str, Any] = {
                        "finish_reason": self._finish_reason(choice, index in calls)
                    }
                    trailing = self._logprobs(choice, sent_tokens.get(index, 0))
                    if trailing and trailing["content"]:
                        extra["logprobs"] = trailing
                    if self.req.return_token_ids:
                        extra["token_ids"] = choice.token_ids[sent_tokens.get(index, 0) :]
                    chunk = self._chunk(index, {}, **extra)
                    if len(done) == job.n and not self.req.include_usage:
                        chunk["usage"] = job.usage()
                    yield sse(chunk)
