"""Anthropic Messages request bodies (`/v1/messages`) and their mapping onto the engine.

Owner: server.

Invariants:
- `max_tokens` is required (as in Anthropic's API); `temperature` is in [0, 1].
- Sampling fields the request leaves unset take the model's generation-config defaults, else
  the engine's (`SamplingDefaults.pick`); the model's `min_p` and `repetition_penalty` always
  apply (the Messages API has no field for them).
- Text, `image` (base64 or url source, in message turns: turned into OpenAI-shaped
  `image_url` parts for `metrale.server.media`), `tool_use` (assistant) and `tool_result`
  (user) blocks are accepted; earlier turns' `thinking` blocks are dropped (templates do not
  replay reasoning); document blocks, images in the system prompt and `mcp_servers` are
  refused with a 400 naming the field. `tools`, `tool_choice`, `thinking` and
  `output_config.format` are the route's `ChatOutputPlan` (`metrale.server.chat_output`).
  `output_config.effort` is accepted and has no effect.
- A conversation must end with a user turn (assistant prefill is not implemented: refused).
- `stop_reason`: "end_turn" (EOS), "stop_sequence" (with `stop_sequence` set), "max_tokens",
  and "timeout" for a request past its deadline.
- `usage.input_tokens` counts the prompt tokens that were not read from the prefix cache;
  `cache_read_input_tokens` the ones that were (Anthropic's convention: their sum is the
  prompt length); `cache_creation_input_tokens` is 0.
- `speculative` and `tenant` are metrale extensions (as on the OpenAI routes); every other
  field Anthropic's API does not define is refused by name.
"""

from __future__ import annotations

from typing import Any, ClassVar

from metrale.engine.request import CompletionOutput
from metrale.errors import InvalidRequestError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import SamplingParams
from metrale.server.protocol.common import SpeculationFields, content_parts, unsupported


class MessagesRequest(SpeculationFields):
    """The Messages body, plus the speculation extensions `speculative` and `tenant` (not
    Anthropic fields: unknown fields are refused here, so these are declared)."""

    #: Routing, accounting and cache hints with no effect on the tokens (caching is automatic).
    IGNORED: ClassVar[frozenset[str]] = frozenset(
        {
            "metadata",
            "service_tier",
            "container",
            "cache_control",
            "diagnostics",
            "inference_geo",
            "speed",
            "user_profile_id",
            "workspace_id",
        }
    )

    model: str | None = None
    max_tokens: int
    messages: list[Any]
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: Any = None
    output_config: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.mcp_servers:
            raise unsupported("mcp_servers", "MCP servers are not implemented")
        if self.thinking is not None:
            kind = self.thinking.get("type") if isinstance(self.thinking, dict) else None
            if kind not in ("enabled", "disabled", "adaptive"):
                raise InvalidRequestError(
                    "thinking must be {'type': 'enabled', 'budget_tokens': N} or "
                    "{'type': 'disabled'}",
                    param="thinking",
                )
            budget = self.thinking.get("budget_tokens")
            if kind == "enabled" and (
                not isinstance(budget, int) or isinstance(budget, bool) or budget < 1
            ):
                raise InvalidRequestError(
                    "thinking.budget_tokens must be a positive integer", param="thinking"
                )
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise InvalidRequestError(
                f"temperature must be in [0, 1], got {self.temperature}", param="temperature"
            )

    def sampling_params(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        """The request's fields, else the model's `defaults`, else `SamplingParams`' own."""
        pick = (defaults or SamplingDefaults()).pick
        return SamplingParams(
            temperature=pick("temperature", self.temperature),
            top_p=pick("top_p", self.top_p),
            top_k=pick("top_k", self.top_k),
            min_p=pick("min_p", None),
            repetition_penalty=pick("repetition_penalty", None),
            max_tokens=self.max_tokens,
            stop=self.stop_sequences or [],
        )


def _image_block(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An `image` block (base64 or url source) as an OpenAI-shaped `image_url` part."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise InvalidRequestError(f"{at}.source needs 'media_type' and base64 'data'", param=at)
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if (
        isinstance(source, dict)
        and source.get("type") == "url"
        and isinstance(source.get("url"), str)
    ):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise InvalidRequestError(
        f"{at}.source must be {{'type': 'base64', 'media_type', 'data'}} or {{'type': 'url', 'url'}}",
        param=at,
    )


def _text_blocks(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """The blocks' text joined; with `images` (message turns), a list of text and image
    parts in order when any `image` block is present."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where} must be a string or a list of content blocks", param=where
        )

    def other(kind: str | None, block: Any, at: str) -> dict[str, Any] | None:
        if kind in ("thinking", "redacted_thinking"):
            return None  # earlier turns' reasoning is not replayed
        if kind == "image" and images:
            return _image_block(block, at)
        if kind in ("image", "document", "tool_use", "tool_result", "search_result", "server_tool_use"):  # fmt: skip
            raise unsupported(at, f"'{kind}' content blocks are not implemented")
        raise InvalidRequestError(
            f"{at} must be a text block {{'type': 'text', 'text': ...}}", param=at
        )

    return content_parts(content, where, other, "")


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request's system prompt and turns as `{role, content: str}` dicts."""
    result: list[dict[str, Any]] = []
    if req.system is not None:
        system = str(_text_blocks(req.system, "system"))
        if system:
            result.append({"role": "system", "content": system})
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequestError(
                f"{where}.role must be 'user' or 'assistant', got {role!r}", param=f"{where}.role"
            )
        if "content" not in message:
            raise InvalidRequestError(f"{where}.content is required", param=f"{where}.content")
        result.extend(_turn(role, message["content"], f"{where}.content"))
    if result[-1]["role"] not in ("user", "tool"):
        raise unsupported(
            f"messages[{len(req.messages) - 1}]",
            "a final assistant turn (prefill) is not implemented; end with a user message",
        )
    return result


def _turn(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat-template messages: an assistant's `tool_use` blocks become
    its `tool_calls`; a user's `tool_result` blocks become `tool` messages (before its
    text, if any)."""
    if not isinstance(content, list):
        return [{"role": role, "content": _text_blocks(content, where, images=True)}]
    plain = [b for b in content if not (isinstance(b, dict) and b.get("type") in _TOOL_BLOCKS)]
    text = _text_blocks(plain, where, images=True)
    messages: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str):
                raise InvalidRequestError(f"{at}.name is required", param=at)
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": block.get("input") or {}},
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            body = _text_blocks(result, f"{at}.content") if result else ""
            if block.get("is_error"):
                body = f"Error: {body}"
            messages.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": body}
            )
        elif kind in _TOOL_BLOCKS:
            raise InvalidRequestError(f"{at}: a {kind} block in a {role} turn", param=at)
    if role == "assistant":
        entry: dict[str, Any] = {"role": role, "content": text}
        if calls:
            entry["tool_calls"] = calls
        return [entry]
    if text or not messages:
        messages.append({"role": role, "content": text})
    return messages


_TOOL_BLOCKS = ("tool_use", "tool_result")


def stop_reason(choice: CompletionOutput) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    reason = choice.finish_reason
    if reason is None:
        return None, None
    if reason == "stop" and isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    if reason == "length":
        return "max_tokens", None
    if reason == "timeout":
        return "timeout", None
    return "end_turn", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }
