"""What every route needs: the engine handle, tokenizer, served model name and metrics.

Owner: server. One `ServerState` per app (built by `create_app`, kept on `app.state`); routes
read it through `server_state(request)`. No module-level mutable state.

Invariants:
- Prompt limits come before the expensive work: `check_prompt_chars` refuses a text prompt
  that cannot fit `prompt_token_limit` tokens (more characters than that many of the
  vocabulary's longest tokens could spell, with a 2x margin for normalisers) before it is
  templated or tokenized; `check_prompt_tokens` checks the count after. Both raise
  `ContextLengthError` (400, `context_length_exceeded`) naming the field.
- `read_json` decodes bodies of `OFFLOAD_BYTES` or more on a worker thread, so the event loop
  (and `/health`) never waits on one big body.
- A request's prefix-cache namespace (`cache_namespace`) joins its key's tenant (under
  `--prefix-cache-isolation api-key`) and its `cache_salt`: different namespaces never share
  a cached block, so `cached_tokens` and TTFT never reveal another tenant's prompts.
- `add_requests` either returns one accepted stream per prompt or raises having aborted the
  ones it had already added, so a bad prompt in a batch leaves nothing running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from metrale.engine.async_engine import EngineHandle, RequestStream
from metrale.engine.engine import DEFAULT_TENANT
from metrale.errors import ContextLengthError, InvalidRequestError, MetraleError, NotFoundError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import MAX_LOGPROBS, SamplingParams
from metrale.server.auth import authenticated_key, lookup_tenant
from metrale.server.errors import PayloadTooLargeError, safe_text
from metrale.server.metrics import ServerMetrics, endpoint_label
from metrale.server.protocol.common import ModelT, decode_json, parse_body
from metrale.server.protocol.responses import ResponseStore
from metrale.server.streaming import ClientDisconnected
from metrale.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: Largest request body accepted (bytes); larger ones get 413.
MAX_BODY_BYTES = 32 * 2**20
#: Bodies of at least this many bytes are decoded on a worker thread.
OFFLOAD_BYTES = 64 * 2**10
#: Margin of the character bound over the token limit (normalisers may shrink text).
_CHAR_BOUND_MARGIN = 2


@dataclass
class ServerState:
    engine: EngineHandle
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    #: "none": one prefix cache for every client; "api-key": one per API key (tenant).
    prefix_cache_isolation: str = "none"
    max_body_bytes: int = MAX_BODY_BYTES
    #: `--max-prompt-tokens`: most prompt tokens a request may send (None: the context's).
    max_prompt_tokens: int | None = None
    #: `--strict-request-fields`: refuse (400) a body field no one defines instead of
    #: ignoring it with a warning and a count.
    strict_request_fields: bool = False
    #: `--max-logprobs`: most top alternatives a request may ask for per position.
    max_logprobs: int = MAX_LOGPROBS
    #: `--pooling`: how `/v1/embeddings` pools a prompt's final hidden states.
    pooling: str = "last"
    #: Stored `/v1/responses` answers (`store`), in this process only.
    responses: ResponseStore = field(default_factory=ResponseStore)
    #: Every name requests may use for the served model (`model_name` first).
    model_aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    _max_token_chars: int | None = field(default=None, repr=False)

    @property
    def prompt_token_limit(self) -> int:
        """Most tokens one prompt may have: `--max-prompt-tokens`, at most the context
        less the one output token every request needs."""
        room = max(self.max_model_len - 1, 1)
        return min(self.max_prompt_tokens, room) if self.max_prompt_tokens else room

    @property
    def max_token_chars(self) -> int:
        """Characters of the vocabulary's longest token (byte-level BPE: its bytes)."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(t) for t in vocab), default=1) or 1
        return self._max_token_chars

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse, before any tokenizing, a text of `chars` characters that cannot fit."""
        bound = self.prompt_token_limit * self.max_token_chars * _CHAR_BOUND_MARGIN
        if chars > bound:
            raise ContextLengthError(
                f"the prompt has {chars} characters, more than {self.prompt_token_limit} "
                f"tokens (the prompt limit) can hold; it was not tokenized",
                param=param,
            )

    def check_prompt_tokens(self, tokens: int, param: str) -> None:
        limit = self.prompt_token_limit
        if tokens > limit:
            why = "--max-prompt-tokens" if limit == self.max_prompt_tokens else "the context"
            raise ContextLengthError(
                f"the prompt has {tokens} tokens; at most {limit} are accepted ({why}: this "
                f"model's maximum context length is {self.max_model_len} tokens)",
                param=param,
            )

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The served model's generation-config sampling defaults (read by the engine)."""
        return self.engine.info.sampling_defaults

    def parse(self, body_type: type[ModelT], raw: object, path: str) -> ModelT:
        """`raw` parsed as `body_type` under the server's request-field policy (see
        `metrale.server.protocol.common`): unknown fields are logged and counted, or refused
        under `--strict-request-fields`."""

        def ignore(names: list[str]) -> None:
            logger.warning(
                "%s: ignoring request fields no one defines: %s",
                path,
                ", ".join(safe_text(n, 64) for n in names),
            )
            self.metrics.ignored_fields.labels(endpoint_label(path)).inc(len(names))

        return parse_body(body_type, raw, None if self.strict_request_fields else ignore)

    def check_model(self, model: str | None) -> None:
        """Refuse a request for a model this server does not serve (404, param "model")."""
        if model is not None and model != self.model_name and model not in self.model_aliases:
            raise NotFoundError(
                f"the model '{safe_text(model, 256)}' does not exist; this server serves "
                f"'{self.model_name}'",
                param="model",
            )

    async def add_requests(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: SamplingParams,
        *,
        prompt_param: str = "prompt",
        speculative: bool = True,
        lookup_tenant: str | None = DEFAULT_TENANT,
        cache_namespace: str | None = None,
        priority: int = 0,
        vision: Any = None,
    ) -> list[RequestStream]:
        """One accepted stream per prompt; errors about the prompt name `prompt_param`.

        `speculative` (the request's opt-out) and `lookup_tenant` (see
        `metrale.server.auth.lookup_tenant`) reach `Engine.add_request` for every prompt."""
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name} asks for {count} alternatives; this server returns at most "
                    f"{self.max_logprobs} (--max-logprobs)",
                    param=name,
                )
        if priority != 0 and self.engine.info.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority needs the server started with --scheduling-policy priority",
                param="priority",
            )
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                stream = await self.engine.add_request(
                    rid, text, params, prompt_token_ids=ids, speculative=speculative,
                    lookup_tenant=lookup_tenant, cache_namespace=cache_namespace,
                    priority=priority, vision=vision,
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


def server_state(request: Request) -> ServerState:
    return request.app.state.metrale  # type: ignore[no-any-return]


def cache_namespace(request: Request, cache_salt: str | None) -> str | None:
    """The prefix-cache namespace of `request`: its API key's tenant under
    `--prefix-cache-isolation api-key`, and its body's `cache_salt`; None (the shared cache)
    when neither applies."""
    parts = []
    if server_state(request).prefix_cache_isolation == "api-key":
        parts.append(lookup_tenant(authenticated_key(request.scope)))
    if cache_salt:
        parts.append(f"salt:{cache_salt}")
    return "|".join(parts) or None


def request_tenant(request: Request, tenant: str | None) -> str:
    """The draft-lookup tenant of `request`: its API key's, subdivided by the body's
    explicit `tenant` (`metrale.server.auth.lookup_tenant`)."""
    return lookup_tenant(authenticated_key(request.scope), tenant)


async def read_json(request: Request, limit: int) -> object:
    """The body, decoded by `decode_json` (off the event loop when large); 413 past `limit`;
    `ClientDisconnected` when the client leaves before sending all of it."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise PayloadTooLargeError(f"the request body is larger than {limit} bytes")
    except ClientDisconnect:
        raise ClientDisconnected("body") from None
    raw = bytes(body)
    del body
    if len(raw) >= OFFLOAD_BYTES:
        return await run_in_threadpool(decode_json, raw)
    return decode_json(raw)
