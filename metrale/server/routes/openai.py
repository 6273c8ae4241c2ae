"""OpenAI routes: `/v1/models` (the base model, then each LoRA adapter with `parent` the
base) and `/v1/chat/completions` (`/v1/completions` is `completions.py`'s; the job and stream
machinery both use is `jobs.py`'s).

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

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.request import CompletionOutput
from metrale.errors import NotFoundError
from metrale.server.chat_output import ChatOutputPlan, openai_plan
from metrale.server.errors import safe_text
from metrale.server.media import template_messages, vision_inputs
from metrale.server.protocol.common import unsupported
from metrale.server.protocol.openai import ChatCompletionRequest, chat_messages
from metrale.server.protocol.openai_output import (
    chat_logprobs_content,
    finish_reason,
    prompt_logprobs_json,
)
from metrale.server.routes.common import open_generation, request_body
from metrale.server.routes.jobs import SYSTEM_FINGERPRINT, Job, Outputs, event_stream
from metrale.server.state import ServerState, server_state
from metrale.server.streaming import sse

router = APIRouter()


# ----------------------------------------------------------------------------- models


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    info = state.engine.info
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "metrale",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
        # What the weights and the KV cache are stored as (FP8 says so: never a silent cast).
        "dtype": info.dtype,
        "weight_dtype": info.weight_dtype or info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype or info.dtype,
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
    job = Job(
        state, request_id, streams, [(text, ids)], params.n, gen.tracker, model=gen.model_name
    )
    # vLLM's `echo`: the answer starts with the final message when it is the assistant's.
    last = messages[-1]
    echoed = last["content"] if req.echo and last["role"] == "assistant" else ""
    echoed = echoed if isinstance(echoed, str) else ""
    view = _ChatView(job, req, plan, text, echoed)
    if req.stream:
        return gen.stream(view.events(), job.close)
    await gen.wait(job.run_to_end(), job.close)
    return JSONResponse(view.response())


@dataclass(eq=False)
class _ChatView:
    job: Job
    req: ChatCompletionRequest
    plan: ChatOutputPlan
    prompt: str
    echoed: str = ""

    def __post_init__(self) -> None:
        self.tokenizer = self.job.state.tokenizer
        self.top = self.req.top_logprobs or 0
        self.as_ids = bool(self.req.return_tokens_as_token_ids)

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
        return event_stream(self.job, self._frames, usage)

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
