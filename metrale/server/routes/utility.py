"""Routes around generation that vLLM and Anthropic clients call: `POST /tokenize`,
`POST /detokenize`, `GET /version`, `POST /v1/messages/count_tokens`.

Owner: server. None of them reaches the engine: they read the served model's tokenizer and
chat template only.

Invariants:
- `/tokenize` takes vLLM's two shapes: `{prompt}` (encoded with `add_special_tokens`, default
  true) or `{messages}` (rendered by the chat template exactly as `/v1/chat/completions`
  renders them, then encoded with `add_special_tokens`, default false). Its answer is
  `{count, max_model_len, tokens, token_strs}`; `token_strs` is null unless
  `return_token_strs` is true.
- On a vision model, image parts count their expanded tokens (decoded and sized as the chat
  routes do, `metrale.server.media`); a text-only model refuses them by name.
- `/detokenize` takes `{tokens}` and answers `{prompt}`; an id outside the vocabulary is a 400
  naming its index.
- `/v1/messages/count_tokens` counts the tokens `/v1/messages` would prefill for the same body
  (`max_tokens` is not needed), answered as `{input_tokens}`.
- Every body names the served model or none (404 otherwise); unknown fields follow the
  server's request-field policy, as on the generation routes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from metrale.errors import InvalidRequestError
from metrale.server.chat_output import anthropic_plan
from metrale.server.media import template_messages, vision_inputs
from metrale.server.protocol.anthropic import MessagesRequest
from metrale.server.protocol.anthropic import chat_messages as anthropic_messages
from metrale.server.protocol.common import RequestModel
from metrale.server.protocol.openai import chat_messages
from metrale.server.routes.common import off_loop, render_chat, request_body
from metrale.server.state import ServerState, read_json, server_state
from metrale.version import __version__

router = APIRouter()


class TokenizeRequest(RequestModel):
    """vLLM's `/tokenize` body: a `prompt`, or chat `messages` and the chat fields."""

    IGNORED: ClassVar[frozenset[str]] = frozenset({"mm_processor_kwargs"})

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages body without `max_tokens`."""

    max_tokens: int = 1  # type: ignore[assignment]


async def _open(request: Request, body_type: type[Any]) -> tuple[ServerState, Any]:
    state = server_state(request)
    body = state.parse(body_type, await read_json(request, state.max_body_bytes), request.url.path)
    state.check_model(body.model)
    return state, body


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(request: Request) -> JSONResponse:
    state, req = await _open(request, TokenizeRequest)
    tokenizer = state.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.prompt is not None:
        state.check_prompt_chars(len(req.prompt), "prompt")
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await off_loop(len(req.prompt), tokenizer.encode, req.prompt, add_special)
    else:
        vision = state.engine.info.vision
        messages, media = await template_messages(vision, chat_messages(req.messages or []))
        chars = sum(len(m["content"]) for m in messages)
        state.check_prompt_chars(chars, "messages")
        kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
        if req.chat_template is not None:
            kwargs["chat_template"] = req.chat_template
        if req.tools is not None:
            kwargs["tools"] = req.tools
        text, ids = await off_loop(
            chars,
            render_chat,
            tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **kwargs,
        )
        if req.add_special_tokens:
            ids = tokenizer.encode(text, add_special_tokens=True)
        ids, _ = await vision_inputs(vision, ids, media)  # image placeholders expanded
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}
    )


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    state, req = await _open(request, DetokenizeRequest)
    vocab = state.tokenizer.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise InvalidRequestError(
                f"tokens[{i}] = {token} is not a token id (the vocabulary has {vocab})",
                param=f"tokens[{i}]",
            )
    text = state.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
async def count_tokens(request: Request) -> JSONResponse:
    state, req = await _open(request, CountTokensRequest)
    req.check_supported()
    vision = state.engine.info.vision
    messages, media = await template_messages(vision, anthropic_messages(req))
    plan = anthropic_plan(
        req, state.tokenizer, state.tool_call_parser, state.reasoning_parser, generating=False
    )  # the tools and enable_thinking render into the prompt as on /v1/messages
    chars = sum(len(m["content"]) for m in messages)
    state.check_prompt_chars(chars, "messages")
    _, ids = await off_loop(
        chars, render_chat, state.tokenizer, messages, add_generation_prompt=True,
        **plan.template_args(),
    )  # fmt: skip
    ids, _ = await vision_inputs(vision, ids, media)  # image placeholders expanded
    return JSONResponse({"input_tokens": len(ids)})
