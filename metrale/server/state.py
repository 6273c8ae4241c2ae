"""What every route needs: the engine handle, tokenizer, served model name and metrics.

Owner: server. One `ServerState` per app (built by `create_app`, kept on `app.state`); routes
read it through `server_state(request)`. No module-level mutable state.

Invariants:
- `add_requests` either returns one accepted stream per prompt or raises having aborted the
  ones it had already added, so a bad prompt in a batch leaves nothing running.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from metrale.engine.async_engine import EngineHandle, RequestStream
from metrale.engine.engine import DEFAULT_TENANT
from metrale.errors import MetraleError, NotFoundError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import SamplingParams
from metrale.server.auth import authenticated_key, lookup_tenant
from metrale.server.errors import PayloadTooLargeError
from metrale.server.metrics import ServerMetrics
from metrale.server.protocol.common import decode_json
from metrale.tokenizer.tokenizer import Tokenizer

#: Largest request body accepted (bytes); larger ones get 413.
MAX_BODY_BYTES = 32 * 2**20


@dataclass
class ServerState:
    engine: EngineHandle
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The served model's generation-config sampling defaults (read by the engine)."""
        return self.engine.info.sampling_defaults

    def check_model(self, model: str | None) -> None:
        """Refuse a request for a model this server does not serve (404, param "model")."""
        if model is not None and model != self.model_name:
            raise NotFoundError(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
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
    ) -> list[RequestStream]:
        """One accepted stream per prompt; errors about the prompt name `prompt_param`.

        `speculative` (the request's opt-out) and `lookup_tenant` (see
        `metrale.server.auth.lookup_tenant`) reach `Engine.add_request` for every prompt."""
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                stream = await self.engine.add_request(
                    rid, text, params, prompt_token_ids=ids, speculative=speculative,
                    lookup_tenant=lookup_tenant,
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


def request_tenant(request: Request, tenant: str | None) -> str:
    """The draft-lookup tenant of `request`: its API key's, subdivided by the body's
    explicit `tenant` (`metrale.server.auth.lookup_tenant`)."""
    return lookup_tenant(authenticated_key(request.scope), tenant)


async def read_json(request: Request, limit: int) -> object:
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise PayloadTooLargeError(f"the request body is larger than {limit} bytes")
    return decode_json(bytes(body))
