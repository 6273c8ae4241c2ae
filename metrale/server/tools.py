"""Tool calling: request tools and tool choice, the per-family tool-call parsers, and the
grammar that makes a required or named call always parse.

Owner: server. The chat and messages routes normalise a request's tools to OpenAI's function
shape (`normalize_tools`, `anthropic_tools`), its tool choice to a `ToolChoice`, pick a
`ToolParser` (`--tool-call-parser`, else from the chat template, else Hermes), pass the tools
to the chat template, and parse the output: `ToolParser.extract` for a finished text,
`ToolCallStream` for a stream (content deltas until the family's tool-call marker, then one
delta per complete call).

Families (`PARSERS`):
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  repeated for parallel calls.
- `qwen3_coder` (Qwen3-Coder XML): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>`.
- `llama3_json` (Llama 3.x): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several joined by `; `.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

Invariants:
- `tool_choice` "required" and a named function constrain the output with an xgrammar
  structural tag of the family's format (`ToolParser.grammar`): only tool calls of the
  allowed tools, their arguments valid against the tool's `parameters` schema, at least one
  call (one only when parallel calls are off or a function is named), then EOS; so the
  output always parses to at least one call.
- "none" neither parses nor constrains; "auto" parses whatever the model wrote (text that
  does not parse as a call stays content).
- Streaming and non-streaming agree: `ToolCallStream` releases as content exactly the text
  `extract` calls content, and its calls, joined, are `extract`'s calls.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.sampling.structured import GrammarSpec, canonical_json
from metrale.server.protocol.common import unsupported

__all__ = [
    "PARSERS",
    "ToolCall",
    "ToolCallStream",
    "ToolChoice",
    "ToolParser",
    "anthropic_tool_choice",
    "anthropic_tools",
    "detect_parser",
    "get_parser",
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


class ToolParser(ABC):
    """One family's tool-call format: parse it (`extract`) and constrain to it (`grammar`).
    A family supplies `calls` (its parse) and `tags` (its structural tags)."""

    name = ""
    #: The text that opens the tool-call part of an output (content stops before it).
    marker = ""

    def start(self, text: str) -> int | None:
        """Where the tool-call part of `text` begins, or None."""
        index = text.find(self.marker)
        return None if index < 0 else index

    @abstractmethod
    def calls(self, tail: str, final: bool) -> list[ToolCall] | None:
        """The complete calls in `tail` (the text from the marker on); with `final`, None if
        it does not parse (then the whole tail is content)."""

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished output."""
        start = self.start(text)
        if start is None:
            return text, []
        calls = self.calls(text[start:], final=True)
        if not calls:
            return text, []
        return text[:start], calls

    @abstractmethod
    def tags(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The structural tags (xgrammar's) of a call of each of `tools`."""

    def grammar(self, tools: list[dict[str, Any]], choice: ToolChoice) -> GrammarSpec:
        """The structural tag allowing only calls of `choice` (required or named)."""
        allowed = [t for t in tools if choice.name in (None, t["function"]["name"])]
        fmt = self.wrap(self.tags(allowed), not choice.parallel)
        tag = {"type": "structural_tag", "format": fmt}
        return GrammarSpec("structural_tag", canonical_json(tag), "tool_choice")

    def wrap(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": single,
        }


def _json_tags(tools: list[dict[str, Any]], begin: str, key: str, end: str) -> list[dict[str, Any]]:
    return [
        {
            "type": "tag",
            "begin": begin + json.dumps({"name": t["function"]["name"]})[:-1] + f', "{key}": ',
            "content": {
                "type": "json_schema",
                "json_schema": t["function"]["parameters"],
                "max_whitespace_cnt": MAX_WHITESPACE,
            },
            "end": "}" + end,
        }
        for t in tools
    ]


def _load_call(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def calls(self, tail: str, final: bool) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for body in self._BLOCK.findall(tail):
            try:
                call = _load_call(json.loads(body, strict=False), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return None if final else calls
            calls.append(call)
        return calls

    def tags(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _json_tags(tools, "<tool_call>\n", "arguments", "\n</tool_call>")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)

    def calls(self, tail: str, final: bool) -> list[ToolCall] | None:
        calls = []
        for name, body in self._BLOCK.findall(tail):
            arguments: dict[str, Any] = {}
            for key, raw in self._PARAM.findall(body):
                raw = raw.strip()  # the grammar, like the format, pads values with whitespace
                try:
                    arguments[key] = json.loads(raw, strict=False)
                except json.JSONDecodeError:
                    arguments[key] = raw
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def tags(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {
                "type": "tag",
                "begin": f"<tool_call>\n<function={t['function']['name']}>\n",
                "content": {
                    "type": "json_schema",
                    "json_schema": t["function"]["parameters"],
                    "style": "qwen_xml",
                    "max_whitespace_cnt": MAX_WHITESPACE,
                },
                "end": "\n</function>\n</tool_call>",
            }
            for t in tools
        ]


def _json_values(text: str) -> tuple[list[Any], str]:
    """The JSON values at the start of `text`, separated by ';' or whitespace, and the rest."""
    decoder = json.JSONDecoder(strict=False)  # raw control characters in strings
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            return values, ""
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, text[pos:]
        values.append(value)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        index = text.find(self.marker)
        if index >= 0:
            return index
        stripped = len(text) - len(text.lstrip())
        return stripped if text[stripped:].startswith("{") else None

    def calls(self, tail: str, final: bool) -> list[ToolCall] | None:
        body = tail.removeprefix(self.marker)
        values, rest = _json_values(body)
        calls = [_load_call(v, "parameters") for v in values]
        if any(c is None for c in calls) or (final and rest.strip()):
            return None if final else []
        return [c for c in calls if c is not None]

    def tags(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _json_tags(tools, "", "parameters", "")

    def wrap(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return {**super().wrap(tags, single), "separator": "; "}


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def calls(self, tail: str, final: bool) -> list[ToolCall] | None:
        values, _ = _json_values(tail.removeprefix(self.marker))
        if not values and not final:
            return []
        if len(values) != 1 or not isinstance(values[0], list):
            return None if final else []
        calls = [_load_call(v, "arguments") for v in values[0]]
        if any(c is None for c in calls):
            return None if final else []
        return [c for c in calls if c is not None]

    def tags(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _json_tags(tools, "", "arguments", "")

    def wrap(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        calls = {**super().wrap(tags, single), "separator": ", "}
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "[TOOL_CALLS]["},
                calls,
                {"type": "const_string", "value": "]"},
            ],
        }


#: Parser names (vLLM's, plus aliases) -> parser class.
PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "qwen3_xml": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise InvalidRequestError(
            f"unknown tool-call parser {name!r} (one of {', '.join(sorted(PARSERS))})",
            param="tool_call_parser",
        ) from None


def detect_parser(template: str | None) -> ToolParser:
    """The family a chat template writes tool calls in (Hermes when it does not say)."""
    source = template or ""
    if "<function=" in source and "<parameter=" in source:
        return Qwen3CoderParser()
    if "[TOOL_CALLS]" in source:
        return MistralParser()
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3JsonParser()
    return HermesParser()


# --------------------------------------------------------------------------- streaming


class ToolCallStream:
    """Incremental split of one choice's text into content deltas and tool calls.

    `feed(text)` takes the choice's cumulative text and returns (content delta, new calls);
    content stops where the tool-call part may begin (a suffix that could open the marker is
    held back until it cannot); `finish()` settles the rest as `extract` would."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # content characters released
        self.calls: list[ToolCall] = []
        self.start: int | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start is None:
            self.start = self.parser.start(text)
        if self.start is None:
            safe = len(text) - _marker_prefix(text, self.parser)
            delta, self.sent = text[self.sent : safe], max(self.sent, safe)
            return delta, []
        delta = text[self.sent : self.start]
        self.sent = max(self.sent, self.start)
        found = self.parser.calls(text[self.start :], final=False) or []
        new = found[len(self.calls) :]
        self.calls.extend(new)
        return delta, new

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """The last content delta and calls, once the text is final."""
        content, calls = self.parser.extract(text)
        if not calls:  # the tail did not parse: it is content after all
            delta = text[self.sent :]
            self.sent = len(text)
            return delta, []
        delta = content[self.sent :]
        self.sent = max(self.sent, len(content))
        # Calls already sent stay as sent (same text, same parse); the rest follow.
        new = calls[len(self.calls) :]
        self.calls.extend(new)
        return delta, new


def _marker_prefix(text: str, parser: ToolParser) -> int:
    """Characters at the end of `text` that could begin the parser's marker."""
    marker = parser.marker
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    if isinstance(parser, Llama3JsonParser) and not text.strip():
        return len(text)  # a call may still open with "{"
    return 0


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
