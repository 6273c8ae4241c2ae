"""What every generation route (completions, chat completions, messages) does first.

Owner: server. `open_generation` reads, parses and checks a generation body and starts its
metrics tracker; `Generation.add` hands its prompts to the engine with the body's speculation
fields, and `Generation.stream` / `Generation.wait` answer it (streamed, or after the wait); `render_chat` turns chat messages into the prompt text and token ids.

Invariants:
- The order of the opening is the same on every route: tracker started, body read (413 past
  `max_body_bytes`; a client leaving meanwhile is a client abort at stage "body"), parsed (400 naming the field), unsupported fields refused, model checked
  (404; a LoRA adapter's name selects it) — all before any engine request exists.
- Every engine request of a generation gets the body's `speculative`, the draft-lookup
  tenant of the request's API key and `tenant` field (`request_tenant`), and its prefix-cache
  namespace (`cache_namespace`: key tenant under isolation, `cache_salt`).
- `Generation.add` either returns one accepted stream per prompt or raises having aborted
  the ones it had already added, so a bad prompt in a batch leaves nothing running.
- A chat prompt's token ids are its rendered text encoded without added special tokens (the
  template writes them).
- Prompts are prepared by `Generation.completion_prompts` / `Generation.chat_prompt`: the
  character bound is checked first (`ServerState.check_prompt_chars`), then a prompt of
  `OFFLOAD_MIN_CHARS` or more is templated and tokenized on a worker thread (the event loop
  keeps answering `/health` and small requests meanwhile), then its token count is checked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from metrale.engine.handle import RequestStream
from metrale.errors import InvalidRequestError, MetraleError
from metrale.sampling.params import SamplingParams
from metrale.server.metrics import RequestTracker
from metrale.server.protocol.common import RequestModel
from metrale.server.protocol.openai import completion_prompts
from metrale.server.state import (
    ServerState,
    cache_namespace,
    read_json,
    request_tenant,
    server_state,
)
from metrale.server.streaming import ClientDisconnected, EventStreamResponse, until_disconnected
from metrale.tokenizer.tokenizer import Tokenizer


class GenerationBody(Protocol):
    """What `open_generation` reads of a parsed body."""

    model: str | None
    speculative: bool
    tenant: str | None
    cache_salt: str | None

    def check_supported(self) -> None: ...

    def session(self) -> str | None: ...


BodyT = TypeVar("BodyT", bound=RequestModel)
#: Cuts a prompt's ids to what `truncate_prompt_tokens` keeps (given the context length).
Truncate = Callable[[list[int], int], list[int]]
R = TypeVar("R")
#: Prompts of at least this many characters are templated and tokenized on a worker thread.
OFFLOAD_MIN_CHARS = 8192


async def off_loop(size: int, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """`fn(*args, **kwargs)`, on a worker thread when `size` reaches `OFFLOAD_MIN_CHARS`."""
    if size >= OFFLOAD_MIN_CHARS:
        return await run_in_threadpool(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def request_body(model: type[RequestModel]) -> dict[str, Any]:
    """The `openapi_extra` that documents a route's JSON body as `model`'s schema (its
    `$defs` inlined), so `/openapi.json` describes what each route reads."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


def _text_chars(prompt: Any) -> int:
    """Characters of a completions prompt's text (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return 0


@dataclass
class Generation(Generic[BodyT]):
    """One HTTP generation request, opened: its state, metrics tracker and parsed body."""

    request: Request
    state: ServerState
    tracker: RequestTracker
    body: BodyT
    #: The LoRA adapter the body's `model` names (0: the base model).
    adapter_id: int = 0

    @property
    def model_name(self) -> str:
        """The `model` answers name: the adapter asked for, else the served model."""
        body: GenerationBody = self.body  # type: ignore[assignment]
        return body.model if self.adapter_id and body.model else self.state.model_name

    async def completion_prompts(
        self, prompt: Any, add_special_tokens: bool = True, truncate: Truncate | None = None
    ) -> list[tuple[str | None, list[int]]]:
        """A completions `prompt` as (text, token ids) pairs, checked against the limits
        (after `truncate`, vLLM's `truncate_prompt_tokens`, cut the ids: a cut prompt keeps
        no text)."""
        state = self.state
        chars = _text_chars(prompt)
        if truncate is None:
            state.check_prompt_chars(chars, "prompt")
        prompts = await off_loop(
            chars, completion_prompts, prompt, state.tokenizer, add_special_tokens
        )
        if truncate is not None:
            cut = [(t, truncate(ids, state.max_model_len)) for t, ids in prompts]
            prompts = [
                (t if len(c) == len(ids) else None, c) for (t, ids), (_, c) in zip(prompts, cut)
            ]
        for _, ids in prompts:
            state.check_prompt_tokens(len(ids), "prompt")
        return prompts

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        param: str = "messages",
        *,
        add_special_tokens: bool = False,
        truncate: Truncate | None = None,
        **template_kwargs: Any,
    ) -> tuple[str | None, list[int]]:
        """`render_chat` of `messages`, checked against the limits (see the invariants);
        `add_special_tokens` and `truncate` are vLLM's fields (a cut prompt keeps no text)."""
        state = self.state
        chars = sum(len(m["content"]) for m in messages)
        if truncate is None:
            state.check_prompt_chars(chars, param)
        text, ids = await off_loop(chars, render_chat, state.tokenizer, messages, **template_kwargs)
        if add_special_tokens:
            ids = state.tokenizer.encode(text, add_special_tokens=True)
        if truncate is not None:
            cut = truncate(ids, state.max_model_len)
            text, ids = (text if len(cut) == len(ids) else None), cut
        state.check_prompt_tokens(len(ids), param)
        return text, ids

    async def add(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: SamplingParams,
        *,
        prompt_param: str = "prompt",
        vision: Any = None,
    ) -> list[RequestStream]:
        """One accepted engine stream per prompt, each with the body's speculation fields
        (see the invariants); errors about the prompt name `prompt_param` (`vision`: the
        one prompt's images, `metrale.server.media.chat_images`)."""
        state = self.state
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > state.max_logprobs:
                raise InvalidRequestError(
                    f"{name} asks for {count} alternatives; this server returns at most "
                    f"{state.max_logprobs} (--max-logprobs)",
                    param=name,
                )
        body: GenerationBody = self.body  # type: ignore[assignment]
        priority = getattr(body, "priority", 0)
        if priority != 0 and state.engine.info.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority needs the server started with --scheduling-policy priority",
                param="priority",
            )
        lookup_tenant = request_tenant(self.request, body.tenant)
        namespace = cache_namespace(self.request, body.cache_salt)
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                stream = await state.engine.add_request(
                    rid, text, params, prompt_token_ids=ids, adapter_id=self.adapter_id,
                    speculative=body.speculative,
                    lookup_tenant=lookup_tenant, cache_namespace=namespace,
                    priority=priority,
                    session_id=body.session(),
                    vision=vision,
                )  # fmt: skip
                streams.append(stream)
        except MetraleError as exc:
            for stream in streams:
                stream.abort()
            if exc.param == "prompt":
                exc.param = prompt_param
            raise
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def stream(self, events: AsyncIterator[str], close: Callable[[], None]) -> Response:
        """A streamed answer of `events`: `close` runs however the stream ends, and a client
        that leaves is counted (`RequestTracker.client_left`)."""
        return EventStreamResponse(events, on_close=close, on_disconnect=self.tracker.client_left)

    async def wait(self, work: Awaitable[R], close: Callable[[], None]) -> R:
        """A non-streamed answer's wait: `work`'s result, unless the client leaves first
        (counted, then `ClientDisconnected` raised); `close` runs however it ends."""
        try:
            return await until_disconnected(self.request, work)
        except ClientDisconnected:
            self.tracker.client_left()
            raise
        finally:
            close()


async def open_generation(request: Request, body_type: type[BodyT]) -> Generation[BodyT]:
    """Start tracking `request`, parse its body as `body_type` and check it."""
    state = server_state(request)
    tracker = state.metrics.track()
    try:
        raw = await read_json(request, state.max_body_bytes)
    except ClientDisconnected:
        tracker.client_left("body")
        raise
    body = state.parse(body_type, raw, request.url.path)
    checked: GenerationBody = body  # type: ignore[assignment]
    checked.check_supported()
    adapter_id = await state.adapter_id(checked.model)
    return Generation(request, state, tracker, body, adapter_id)


#: Stands in for the final assistant message while its turn's closing is cut off.
_CONTINUE_MARK = "\u27e6metrale:continue\u27e7"


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """The chat template's text for `messages` and its token ids.

    `continue_final_message` (vLLM's): the prompt ends inside the final assistant message,
    right after its text (the template's end-of-turn markup is cut), so the model continues
    that message; it excludes `add_generation_prompt`."""
    if not continue_final_message:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return text, tokenizer.encode(text, add_special_tokens=False)
    if add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true (set "
            "add_generation_prompt to false)",
            param="continue_final_message",
        )
    if not messages or messages[-1]["role"] != "assistant":
        raise InvalidRequestError(
            "continue_final_message needs the last message to be an assistant turn",
            param="messages",
        )
    final = messages[-1]["content"]
    marked = [*messages[:-1], {**messages[-1], "content": _CONTINUE_MARK}]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=False, **template_kwargs)
    cut = text.rfind(_CONTINUE_MARK)
    if cut < 0:
        raise InvalidRequestError(
            "the chat template does not write the final assistant message's content, so it "
            "cannot be continued",
            param="continue_final_message",
        )
    text = text[:cut] + final
    return text, tokenizer.encode(text, add_special_tokens=False)
