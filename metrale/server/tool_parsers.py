"""Tool calling's per-family parsers: parse a model's tool-call output (`ToolParser.extract`
for a finished text, `ToolCallStream` for a stream: content deltas until the family's marker,
then one delta per complete call), and the grammar that makes a required or named call
always parse (`ToolParser.grammar`). The request side (tools, tool choice, messages) is
`metrale.server.tools`.

Owner: server. Families (`PARSERS`):
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
- Streaming and non-streaming agree: `ToolCallStream` releases as content exactly the text
  `extract` calls content, and its calls, joined, are `extract`'s calls.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.sampling.structured import GrammarSpec, canonical_json
from metrale.server.tools import MAX_WHITESPACE, ToolCall, ToolChoice

__all__ = ["PARSERS", "ToolCallStream", "ToolParser", "detect_parser", "get_parser"]


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
