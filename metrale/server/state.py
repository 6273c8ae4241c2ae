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
- LoRA: `loras` mirrors the engine's adapter registry (name -> id); a request's `model` names
  the base model or an adapter (`adapter_id`), anything else is a 404. The server hands out
  the ids of adapters loaded at run time (`next_adapter_id`, never reused), and after an
  engine restart loads those adapters into the new engine under the same ids before routing
  to them, so an id always means the same weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from metrale.engine.async_engine import EngineHandle
from metrale.errors import ContextLengthError, MetraleError, NotFoundError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import MAX_LOGPROBS
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
    #: `--tool-call-parser` (None: from the chat template) and `--reasoning-parser` (None:
    #: off); see `metrale.server.chat_output`.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
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
    #: LoRA adapters served, by name; None when the engine serves none (LoRA off).
    loras: dict[str, ServedAdapter] | None = None
    #: `--enable-lora-runtime-updates`: the load/unload endpoints are on.
    lora_runtime_updates: bool = False
    _max_token_chars: int | None = field(default=None, repr=False)
    #: Engine restarts seen when the adapters were last known to be loaded in the engine.
    _lora_restarts: int = field(default=0, repr=False)
    _lora_lock: asyncio.Lock | None = field(default=None, repr=False)
    _lora_next: int = field(default=1, repr=False)

    def __post_init__(self) -> None:
        adapters = self.engine.info.lora_adapters
        if adapters is not None and self.loras is None:
            self.loras = {n: ServedAdapter(n, i, p, runtime=False) for n, i, p in adapters}
        self._lora_restarts = _restarts(self.engine)

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
        known = (self.model_name, *self.model_aliases, *(self.loras or {}))
        if model is not None and model not in known:
            served = ", ".join(repr(n) for n in [self.model_name, *(self.loras or {})])
            raise NotFoundError(
                f"the model '{safe_text(model, 256)}' does not exist; this server serves {served}",
                param="model",
            )

    async def adapter_id(self, model: str | None) -> int:
        """The engine's adapter id of the requested `model` (0: the base model); 404 for a
        model not served. After an engine restart, adapters loaded at run time are loaded
        into the new engine first (under their ids)."""
        self.check_model(model)
        if model is None or model == self.model_name or model in self.model_aliases:
            return 0
        if self.loras is None:
            return 0
        await self._reload_after_restart()
        entry = self.loras.get(model)
        if entry is None:
            self.check_model(model)  # it could not be loaded again: 404, naming it
        assert entry is not None
        return entry.adapter_id

    def next_adapter_id(self) -> int:
        """A fresh adapter id: above every id this server has seen, so no prefix-cache
        namespace is reused, not even across engine restarts."""
        self._lora_next = max(
            [self._lora_next, *(a.adapter_id + 1 for a in (self.loras or {}).values())]
        )
        taken, self._lora_next = self._lora_next, self._lora_next + 1
        return taken

    def lora_lock(self) -> asyncio.Lock:
        """Serialises the server's changes to the adapter registry."""
        if self._lora_lock is None:
            self._lora_lock = asyncio.Lock()
        return self._lora_lock

    async def _reload_after_restart(self) -> None:
        restarts = _restarts(self.engine)
        if restarts == self._lora_restarts or self.loras is None:
            return
        async with self.lora_lock():
            if restarts == self._lora_restarts:
                return
            for entry in [e for e in self.loras.values() if e.runtime]:
                try:
                    await self.engine.control(
                        "load_lora_adapter", entry.name, entry.path, entry.adapter_id
                    )
                except MetraleError as exc:
                    logger.error(
                        "LoRA adapter %s could not be loaded into the restarted engine: %s",
                        entry.name, exc.message,
                    )  # fmt: skip
                    del self.loras[entry.name]
            self._lora_restarts = restarts


@dataclass
class ServedAdapter:
    """A LoRA adapter the server routes requests to (`model` names it)."""

    name: str
    adapter_id: int
    path: str
    #: Loaded through `/v1/load_lora_adapter` (not `--lora-modules`): an engine restart
    #: must load it again.
    runtime: bool = True


def _restarts(engine: object) -> int:
    """How often a supervised engine has restarted (0 for a plain handle)."""
    return int(getattr(engine, "restarts", 0) or 0)


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
