"""Tool-call parsers per family, the tool-choice grammar, and the reasoning split: each
family's own text parses to the calls in it; streamed one character at a time the deltas
reassemble to exactly the finished parse; text without calls stays content; the constrained
grammar of every family, sampled at temperature 1 on the bundled model, always parses to
calls of the allowed tools with arguments valid for their schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import InvalidRequestError
from metrale.server.reasoning import ReasoningStream, get_reasoning_parser
from metrale.server.tool_parsers import ToolCallStream, detect_parser, get_parser
from metrale.server.tools import (
    ToolChoice,
    anthropic_tool_choice,
    normalize_tool_choice,
    normalize_tools,
)

TOOLS = normalize_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 12},
                        "unit": {"enum": ["c", "f"]},
                    },
                    "required": ["city", "unit"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "minimum": 0, "maximum": 99},
                        "b": {"type": "integer", "minimum": -5, "maximum": 5},
                    },
                    "required": ["a", "b"],
                },
            },
        },
    ]
)

CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": -3})]

TEXTS = {
    "hermes": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": -3}}'
    "\n</tool_call>",
    "qwen3_coder": "Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n-3\n</parameter>\n"
    "</function>\n</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
    '"unit": "c"}}; {"name": "add", "parameters": {"a": 2, "b": -3}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}, {"name": "add", "arguments": {"a": 2, "b": -3}}]',
}


@pytest.mark.parametrize("family", sorted(TEXTS))
def test_family_parses_its_format(family: str) -> None:
    parser = get_parser(family)
    content, calls = parser.extract(TEXTS[family])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert content == ("" if family == "llama3_json" else "Let me check.")
    assert parser.extract("no calls here, just text") == ("no calls here, just text", [])


@pytest.mark.parametrize("family", sorted(TEXTS))
def test_streamed_deltas_reassemble_to_the_finished_parse(family: str) -> None:
    parser = get_parser(family)
    text = TEXTS[family]
    stream = ToolCallStream(parser)
    content, calls = "", []
    for end in range(1, len(text) + 1):
        delta, new = stream.feed(text[:end])
        content += delta
        calls += new
    delta, new = stream.finish(text)
    content += delta
    calls += new
    expected_content, expected_calls = parser.extract(text)
    assert content == expected_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected_calls]


def test_stream_releases_a_held_back_marker_prefix_that_was_not_one() -> None:
    stream = ToolCallStream(get_parser("hermes"))
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("a <tooth") == ("<tooth", [])


def test_detect_parser_from_template() -> None:
    assert detect_parser("{{ '<tool_call>' }}").name == "hermes"
    assert detect_parser("<function={{ n }}><parameter={{ p }}>").name == "qwen3_coder"
    assert detect_parser("[TOOL_CALLS]").name == "mistral"
    assert detect_parser("<|python_tag|>").name == "llama3_json"
    assert detect_parser(None).name == "hermes"
    templates = Path(__file__).parents[1] / "server" / "templates"
    for name, family in (("qwen3_tools", "hermes"), ("llama3_tools", "llama3_json"),
                         ("mistral_tools", "mistral")):  # fmt: skip
        assert detect_parser((templates / f"{name}.jinja").read_text()).name == family
    with pytest.raises(InvalidRequestError, match="unknown tool-call parser"):
        get_parser("nope")


def test_tool_choice_rules() -> None:
    assert normalize_tool_choice(None, TOOLS).mode == "auto"
    assert normalize_tool_choice("required", TOOLS, parallel=False) == ToolChoice(
        "required", parallel=False
    )
    named = normalize_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS)
    assert named == ToolChoice("named", "add", parallel=False)
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        normalize_tool_choice({"type": "function", "function": {"name": "x"}}, TOOLS)
    with pytest.raises(InvalidRequestError, match="needs tools"):
        normalize_tool_choice("required", [])
    assert anthropic_tool_choice({"type": "any"}, TOOLS).mode == "required"
    assert anthropic_tool_choice({"type": "tool", "name": "add"}, TOOLS).name == "add"
    with pytest.raises(InvalidRequestError, match="defined twice"):
        normalize_tools([TOOLS[0], TOOLS[0]])


@pytest.fixture(scope="module")
def bundled() -> LLM:
    return LLM(None, device="cpu", num_kv_blocks=256)


@pytest.mark.parametrize("family", sorted(TEXTS))
def test_constrained_calls_always_parse(bundled: LLM, family: str) -> None:
    parser = get_parser(family)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in (ToolChoice("required", parallel=False), ToolChoice("named", "add", False)):
        params = SamplingParams(
            temperature=1.0,
            max_tokens=192,
            n=8,
            seed=11,
            structured_outputs=parser.grammar(TOOLS, choice),
        )
        (out,) = bundled.generate(["# call a tool\n"], params)
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            content, calls = parser.extract(sample.text)
            assert content == "" and len(calls) == 1, sample.text
            call = calls[0]
            assert choice.name in (None, call.name)
            arguments = json.loads(call.arguments)
            assert set(arguments) == set(schemas[call.name]["required"])
            if call.name == "add":
                assert 0 <= arguments["a"] <= 99 and -5 <= arguments["b"] <= 5
            else:
                assert arguments["unit"] in ("c", "f")


@pytest.mark.parametrize(
    ("text", "prompt", "reasoning", "content"),
    [
        ("<think>\nplan</think>\n\nThe answer", "", "\nplan", "The answer"),
        ("just an answer", "", None, "just an answer"),
        ("plan</think>\n\nok", "<|im_start|>assistant\n<think>\n", "plan", "ok"),
        ("<think>never closed", "", "never closed", ""),
        ("<thi", "", None, "<thi"),
    ],
)
def test_reasoning_split_streaming_equals_finished(
    text: str, prompt: str, reasoning: str | None, content: str
) -> None:
    parser = get_reasoning_parser("qwen3")
    assert parser.split(text, prompt) == (reasoning, content)
    stream = ReasoningStream(parser, prompt)
    r = c = ""
    for end in range(1, len(text) + 1):
        dr, dc = stream.feed(text[:end])
        r, c = r + dr, c + dc
    dr, dc = stream.finish(text)
    assert (r + dr if stream.saw_reasoning else None, c + dc) == (reasoning, content)
