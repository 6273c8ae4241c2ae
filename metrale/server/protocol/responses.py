"""OpenAI Responses request bodies (`/v1/responses`) and the objects of their answers.

Owner: server. `ResponsesRequest` validates a body; `conversation` turns `instructions`, a
stored predecessor (`previous_response_id`) and `input` into the chat messages the model's
template renders; `response_object` builds the `response` object; `ResponseStore` keeps the
stored ones (`store`) in this process.

Invariants:
- `input` is a string (one user message) or a list of items: messages (`role` user, system,
  developer or assistant; content a string or `input_text` / `output_text` parts),
  `function_call` (an assistant turn's tool call; consecutive ones are one turn) and
  `function_call_output` (a tool message). Item types the server cannot act on (images,
  files) are refused with a 400 naming the item. `tools` (function tools), `tool_choice` and
  `text.format` are the route's `ChatOutputPlan` (`metrale.server.chat_output`).
- `instructions` is a system message placed first; it is not carried over to a successor
  (OpenAI's rule: `previous_response_id` brings the turns, not the instructions).
- `store` (default true, as OpenAI) keeps the response's conversation in `ResponseStore`:
  in this process only, the newest `MAX_STORED` kept, lost at restart. A
  `previous_response_id` the store does not hold is a 404 naming it.
- Sampling: `temperature`, `top_p`, `max_output_tokens` as on chat completions; `top_k` and
  the other vLLM fields are not part of this API.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from metrale.errors import InvalidRequestError, NotFoundError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import SamplingParams
from metrale.server.protocol.common import SpeculationFields, unsupported
from metrale.server.tools import responses_input_item

#: Most stored responses kept (the oldest are forgotten first).
MAX_STORED = 1024


class ResponsesRequest(SpeculationFields):
    """The Responses body (the fields this server acts on, and those it accepts unchanged)."""

    IGNORED: ClassVar[frozenset[str]] = frozenset(
        {"metadata", "user", "service_tier", "truncation", "include", "safety_identifier",
         "prompt_cache_key", "parallel_tool_calls", "stream_options"}
    )  # fmt: skip

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    seed: int | None = None

    def check_supported(self) -> None:
        if self.background:
            raise unsupported("background", "background responses are not implemented")
        # tools, tool_choice and text.format: `metrale.server.chat_output.responses_plan`.

    def sampling_params(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        pick = (defaults or SamplingDefaults()).pick
        return SamplingParams(
            temperature=pick("temperature", self.temperature),
            top_p=pick("top_p", self.top_p),
            top_k=pick("top_k", None),
            min_p=pick("min_p", None),
            repetition_penalty=pick("repetition_penalty", None),
            max_tokens=self.max_output_tokens,
            seed=self.seed,
        )


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise unsupported(at, f"'{kind}' parts are not implemented")
        else:
            raise InvalidRequestError(
                f"{at} must be an input_text part {{'type': 'input_text', 'text': ...}}",
                param=at,
            )
    return "".join(texts)


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """`input` as `{role, content: str}` messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            message = responses_input_item(item, where)
            last = messages[-1] if messages else None
            if (
                kind == "function_call"
                and last is not None
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"] += message["tool_calls"]  # parallel calls: one turn
            else:
                messages.append(message)
            continue
        if kind != "message":
            raise unsupported(where, f"'{kind}' input items are not implemented")
        role = item.get("role")
        if role == "developer":
            role = "system"
        if role not in ("user", "system", "assistant"):
            raise InvalidRequestError(
                f"{where}.role must be one of user, system, developer, assistant; got {role!r}",
                param=f"{where}.role",
            )
        messages.append(
            {"role": role, "content": _item_text(item.get("content"), f"{where}.content")}
        )
    return messages


@dataclass
class StoredResponse:
    """What a successor needs: the turns so far (without instructions) and the object."""

    turns: list[dict[str, Any]]
    body: dict[str, Any]


@dataclass
class ResponseStore:
    """Stored responses by id, in this process, newest `MAX_STORED` kept."""

    limit: int = MAX_STORED
    _items: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> StoredResponse:
        with self._lock:
            stored = self._items.get(response_id)
        if stored is None:
            raise NotFoundError(
                f"no stored response '{response_id[:128]}' (responses are stored in this "
                "server process only, the newest few kept, and only with store: true)",
                param=param,
            )
        return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None


def conversation(
    req: ResponsesRequest, store: ResponseStore
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages to render, the turns a successor carries over): the predecessor's turns,
    then `input`; `instructions` first in the rendered messages only."""
    turns: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        turns = list(store.get(req.previous_response_id).turns)
    turns += input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system + turns, turns


def usage(
    prompt_tokens: int, cached: int, output_tokens: int, reasoning_tokens: int = 0
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    model: str,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage_block: dict[str, Any] | None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """The `response` object (also the payload of the stream's lifecycle events)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": bool(req.store),
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": req.text if req.text and req.text.get("format") else {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": usage_block,
        "user": None,
        "metadata": req.metadata or {},
    }


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    """A `reasoning` output item: the model's thinking, split off the answer."""
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def now() -> int:
    return int(time.time())
