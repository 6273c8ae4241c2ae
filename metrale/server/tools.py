"""Tool calling, the request side: a request's tools, tool choice and tool messages in every
API's shape (the per-family parsers and their grammars are `metrale.server.tool_parsers`).

Owner: server. The chat and messages routes normalise a request's tools to OpenAI's function
shape (`normalize_tools`, `anthropic_tools`), its tool choice to a `ToolChoice`, pick a
`ToolParser` (`--tool-call-parser`, else from the chat template, else Hermes), pass the tools
to the chat template, and parse the output: `ToolParser.extract` for a finished text,
`ToolCallStream` for a stream (content deltas until the family's tool-call marker, then one
delta per complete call).

Invariants:
- "none" neither parses nor constrains; "auto" parses whatever the model wrote (text that
  does not parse as a call stays content).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.server.protocol.common import unsupported

__all__ = [
    "ToolCall",
    "ToolChoice",
    "anthropic_tool_choice",
    "anthropic_tools",
    "normalize_tool_choice",
    "normalize_tools",
    "openai_tool_messages",
    "responses_function_item",
    "responses_input_item",
    "responses_tool_choice",
    "responses_tools",
]

#: Most consecutive whitespace characters a constrained call's arguments may hold (unbounded
#: whitespace lets a small model pad until max_tokens and never close the call).
MAX_WHITESPACE = 1
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass
class ToolCall:
    name: str
    #: The arguments as JSON text (OpenAI's `function.arguments`).
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            entry["index"] = index
        return entry

    @property
    def input(self) -> Any:
        """The arguments as a JSON value (Anthropic's `tool_use.input`)."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}


# ----------------------------------------------------------------------- request side


def normalize_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """OpenAI `tools` as `[{"type": "function", "function": {name, description?,
    parameters}}]` (parameters default to an empty object schema); names unique."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError(f"{param} must be a list", param=param)
    result: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise unsupported(at, f"only function tools are implemented, got {kind!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{at}.function must be an object", param=at)
        result.append(_function(function, at, seen))
    return result


def _function(function: dict[str, Any], at: str, seen: set[str]) -> dict[str, Any]:
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            f"{at}: a tool name must be 1-128 letters, digits, '_', '.', ':' or '-', got {name!r}",
            param=at,
        )
    if name in seen:
        raise InvalidRequestError(f"{at}: tool {name!r} is defined twice", param=at)
    seen.add(name)
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{at}.parameters must be a JSON schema object", param=at)
    entry: dict[str, Any] = {"name": name, "parameters": parameters}
    if isinstance(function.get("description"), str):
        entry["description"] = function["description"]
    return {"type": "function", "function": entry}


def anthropic_tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic `tools` (`name`, `description`, `input_schema`) in OpenAI's shape."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    result: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{at} must be an object", param=at)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise unsupported(at, f"server tools ({kind!r}) are not implemented")
        result.append(
            _function(
                {
                    "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": tool.get("input_schema"),
                },
                at,
                seen,
            )
        )
    return result


@dataclass(frozen=True)
class ToolChoice:
    """`mode`: "none", "auto", "required" or "named" (then `name`); `parallel`: several calls."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def normalize_tool_choice(
    choice: Any, tools: list[dict[str, Any]], parallel: Any = None
) -> ToolChoice:
    """OpenAI `tool_choice` (+ `parallel_tool_calls`) against the request's tools."""
    parallel_ok = parallel is None or bool(parallel)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return ToolChoice("none")
    if choice is None or choice == "auto":
        return ToolChoice("auto", parallel=parallel_ok)
    if choice in ("none", "required"):
        return ToolChoice(choice, parallel=parallel_ok)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        return _named(name, tools, "tool_choice")
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def _named(name: Any, tools: list[dict[str, Any]], param: str) -> ToolChoice:
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise InvalidRequestError(
            f"{param} names {name!r}, which is not among the tools ({', '.join(names)})",
            param=param,
        )
    return ToolChoice("named", name=name, parallel=False)


def anthropic_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """Anthropic `tool_choice` (`auto`, `any`, `tool` + `name`, `none`,
    `disable_parallel_tool_use`)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if not isinstance(choice, dict):
        raise InvalidRequestError("tool_choice must be an object", param="tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "none" or not tools:
        if kind not in ("none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return ToolChoice("none")
    if kind == "auto":
        return ToolChoice("auto", parallel=parallel)
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool":
        return _named(choice.get("name"), tools, "tool_choice.name")
    raise InvalidRequestError(
        f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice"
    )


def openai_tool_messages(message: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """The tool fields of one OpenAI chat message, as chat templates read them: an assistant's
    `tool_calls` (arguments parsed to objects where they are JSON), a tool message's
    `tool_call_id` (and `name`)."""
    extra: dict[str, Any] = {}
    if role == "assistant" and message.get("tool_calls"):
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise InvalidRequestError(f"{where}.tool_calls must be a list", param=where)
        extra["tool_calls"] = [template_call(call, f"{where}.tool_calls[{j}]")
                               for j, call in enumerate(calls)]  # fmt: skip
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}.tool_call_id must be a string", param=where)
        extra["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            extra["name"] = message["name"]
    return extra


def template_call(call: Any, where: str) -> dict[str, Any]:
    """One tool call as templates read it: `{"id", "type": "function", "function": {"name",
    "arguments": object}}` (a JSON-text `arguments` is parsed)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where} must have function.name", param=where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else the template gets the text
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


# ---------------------------------------------------------------------------- parsers


# ------------------------------------------------------------------- Responses API shapes


def responses_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses `tools` (flat: `{"type": "function", "name", "description", "parameters"}`)
    in the chat shape; other tool types (web search, file search, ...) are refused by name."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    nested = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(f"tools[{i}]", f"only function tools are implemented, got {kind!r}")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        nested.append({"type": "function", "function": function})
    return normalize_tools(nested)


def responses_tool_choice(choice: Any, tools: list[dict[str, Any]], parallel: Any) -> ToolChoice:
    """Responses `tool_choice`: "auto", "none", "required" or `{"type": "function", "name"}`."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return normalize_tool_choice(choice, tools, parallel)


def responses_input_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `function_call` input item as an assistant message with that tool call, a
    `function_call_output` as a tool message."""
    kind = item.get("type")
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
        }
        return {"role": "assistant", "content": "", "tool_calls": [template_call(call, where)]}
    output = item.get("output", "")
    if not isinstance(output, str):
        output = json.dumps(output, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}


def responses_function_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    """A tool call as a Responses `function_call` output item."""
    return {
        "type": "function_call",
        "id": f"fc_{call.id[5:]}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }
