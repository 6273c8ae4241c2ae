"""OpenAI `/v1/completions`: plain, echoed and fill-in-the-middle prompts, one engine request
per prompt, answered as one JSON body or an SSE stream of chunks ending in `data: [DONE]`.

Owner: server. Invariants:
- Choice indices number `prompt_index * n + i` over the body's prompts.
- Streamed text deltas concatenate to exactly the non-streamed text; `echo` puts the prompt
  (and its logprobs) first, and `max_tokens: 0` with `echo` answers with the prompt alone.
- `usage` is on every JSON response; in a stream it is on a final `choices: []` chunk with
  `stream_options.include_usage`, otherwise on the last choice chunk.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from metrale.engine.request import CompletionOutput, RequestOutput
from metrale.server.protocol.openai import CompletionRequest
from metrale.server.protocol.openai_output import (
    CompletionLogprobs,
    finish_reason,
    merge_completion_logprobs,
    prompt_logprobs_json,
)
from metrale.server.routes.common import open_generation, request_body
from metrale.server.routes.jobs import SYSTEM_FINGERPRINT, Job, Outputs, event_stream
from metrale.server.streaming import sse
from metrale.tokenizer.fim import fim_prompt

router = APIRouter()


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
    job = Job(state, request_id, streams, prompts, params.n, gen.tracker, model=gen.model_name)
    view = _CompletionView(job, req, echo, echo_only)
    if req.stream:
        return gen.stream(view.events(), job.close)
    await gen.wait(job.run_to_end(), job.close)
    return JSONResponse(view.response())


class _CompletionView:
    """Renders a completions job as one JSON body or as SSE chunks."""

    def __init__(self, job: Job, req: CompletionRequest, echo: bool, echo_only: bool) -> None:
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
        return event_stream(self.job, self._frames, usage)

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
