"""What every generation route (completions, chat completions, messages) does first.

Owner: server. `open_generation` reads, parses and checks a generation body and starts its
metrics tracker; `Generation.add` hands its prompts to the engine with the body's speculation
fields; `render_chat` turns chat messages into the prompt text and token ids.

Invariants:
- The order of the opening is the same on every route: tracker started, body read (413 past
  `max_body_bytes`), parsed (400 naming the field), unsupported fields refused, model checked
  (404) — all before any engine request exists.
- Every engine request of a generation gets the body's `speculative` and the draft-lookup
  tenant of the request's API key and `tenant` field (`request_tenant`).
- A chat prompt's token ids are its rendered text encoded without added special tokens (the
  template writes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.requests import Request

from metrale.engine.handle import RequestStream
from metrale.sampling.params import SamplingParams
from metrale.server.metrics import RequestTracker
from metrale.server.protocol.common import RequestModel, parse_body
from metrale.server.state import ServerState, read_json, request_tenant, server_state
from metrale.tokenizer.tokenizer import Tokenizer


class GenerationBody(Protocol):
    """What `open_generation` reads of a parsed body."""

    model: str | None
    speculative: bool
    tenant: str | None

    def check_supported(self) -> None: ...


BodyT = TypeVar("BodyT", bound=RequestModel)


@dataclass
class Generation(Generic[BodyT]):
    """One HTTP generation request, opened: its state, metrics tracker and parsed body."""

    request: Request
    state: ServerState
    tracker: RequestTracker
    body: BodyT

    async def add(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: SamplingParams,
        *,
        prompt_param: str = "prompt",
    ) -> list[RequestStream]:
        """`ServerState.add_requests` with the body's speculation fields."""
        body: GenerationBody = self.body  # type: ignore[assignment]
        return await self.state.add_requests(
            request_id,
            prompts,
            params,
            prompt_param=prompt_param,
            speculative=body.speculative,
            lookup_tenant=request_tenant(self.request, body.tenant),
        )


async def open_generation(request: Request, body_type: type[BodyT]) -> Generation[BodyT]:
    """Start tracking `request`, parse its body as `body_type` and check it."""
    state = server_state(request)
    tracker = state.metrics.track()
    body = parse_body(body_type, await read_json(request, state.max_body_bytes))
    checked: GenerationBody = body  # type: ignore[assignment]
    checked.check_supported()
    state.check_model(checked.model)
    return Generation(request, state, tracker, body)


def render_chat(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], **template_kwargs: Any
) -> tuple[str, list[int]]:
    """The chat template's text for `messages` and its token ids."""
    text = tokenizer.apply_chat_template(messages, **template_kwargs)
    return text, tokenizer.encode(text, add_special_tokens=False)
