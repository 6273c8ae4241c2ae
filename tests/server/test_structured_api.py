"""Structured output, tool calling and reasoning through the official SDKs, on the bundled
model served with a Qwen3-style chat template (Hermes tool calls, `<think>` reasoning) and
`--reasoning-parser qwen3`.

- `client.chat.completions.parse(response_format=<pydantic model>)`: 100 of 100 samples at
  temperature 1 parse into the model (one request, n=100);
- `tool_choice="required"` gives a parseable call; streamed, the deltas reassemble to the
  same call (greedy: the same tokens);
- the Anthropic SDK's tool-use round trip (tool_use, then tool_result back through the
  template), streamed too; `output_config.format`; `thinking` with its budget;
- `reasoning_content` split from the content, streamed the same;
- vLLM's `guided_*` / `structured_outputs`; refusals name the field and the construct.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import pytest
from anthropic import Anthropic
from openai import OpenAI
from pydantic import BaseModel, Field

from metrale.engine.intake import BUNDLED_MODEL_DIR
from tests.server.helpers import ServerProcess, assert_openai_error

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_tools.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice", "--num-kv-blocks", "512",
        checkpoint=str(BUNDLED_MODEL_DIR),
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_parse_pydantic_100_of_100_at_temperature_1(client: OpenAI, model: str) -> None:
    completion = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet,
        temperature=1.0,
        n=100,
        max_tokens=80,
        seed=1234,
    )
    assert len(completion.choices) == 100
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Pet), choice.message.content
    assert len({c.message.content for c in completion.choices}) > 10  # really sampled


def test_tool_choice_required_and_its_stream(client: OpenAI, model: str) -> None:
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 96,
    }
    response = client.chat.completions.create(**request)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert call.id.startswith("call_")

    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                args[delta.index] = args.get(delta.index, "") + (delta.function.arguments or "")
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert names == {0: "get_weather"} and json.loads(args[0]) == arguments


def test_named_tool_and_tool_result_round_trip(client: OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
    )
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "-3 degrees, snow"},
    ]
    second = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result went in


def test_anthropic_tool_use_round_trip(server: ServerProcess) -> None:
    claude = Anthropic(base_url=server.url, api_key="unused")
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    request = {
        "model": "tiny-code",
        "max_tokens": 96,
        "tools": [tool],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }
    first = claude.messages.create(messages=messages, **request)
    assert first.stop_reason == "tool_use"
    counted = claude.messages.count_tokens(model="tiny-code", messages=messages, tools=[tool])
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather"
    assert set(use.input) == {"city", "unit"}
    with claude.messages.stream(messages=messages, **request) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].type == "tool_use"
    assert set(streamed.content[-1].input) == {"city", "unit"}
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "25 C"}],
        },
    ]
    answer = claude.messages.create(
        model="tiny-code", max_tokens=8, messages=messages, tools=[tool]
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    )


def test_anthropic_output_format_and_thinking_budget(server: ServerProcess) -> None:
    claude = Anthropic(base_url=server.url, api_key="unused")
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    message = claude.messages.create(
        model="tiny-code",
        max_tokens=40,
        messages=[{"role": "user", "content": "Yes or no?"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert json.loads(message.content[0].text)["answer"] in ("yes", "no")

    request = {
        "model": "tiny-code",
        "max_tokens": 30,
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "thinking": {"type": "enabled", "budget_tokens": 8},
    }
    thought = claude.messages.create(**request)
    counted = claude.messages.count_tokens(
        model="tiny-code", messages=request["messages"], thinking=request["thinking"]
    )
    assert counted.input_tokens > 0
    assert [b.type for b in thought.content][:1] == ["thinking"]
    assert thought.usage.output_tokens <= 30
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "thinking"
    too_big = {**request, "thinking": {"type": "enabled", "budget_tokens": 30}}
    response = httpx.post(server.url + "/v1/messages", json=too_big, timeout=30)
    assert response.status_code == 400 and "budget_tokens" in response.text


def test_reasoning_content_split_streaming_too(client: OpenAI, model: str) -> None:
    # The grammar makes the model write a reasoning block, so the split has one to find.
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "Think first."}],
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"guided_regex": r"<think>\n[a-z]{3,8}\n</think>\n\n[a-z]{2,6}"},
    }
    message = client.chat.completions.create(**request).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.strip().isalpha() and 3 <= len(reasoning.strip()) <= 8
    assert message.content.isalpha() and "<think>" not in message.content
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            parts["reasoning_content"] += extra.get("reasoning_content") or ""
            parts["content"] += choice.delta.content or ""
    assert parts == {"reasoning_content": reasoning, "content": message.content}


def test_vllm_constraint_fields(server: ServerProcess, client: OpenAI, model: str) -> None:
    choice = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Pick a colour"}],
        max_tokens=8,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert choice.choices[0].message.content in ("red", "green", "blue")
    completion = client.completions.create(
        model=model,
        prompt="x = ",
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": "[0-9]{2,4}"}},
    )
    assert completion.choices[0].text.isdigit()
    obj = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=60,
        response_format={"type": "json_object"},
        extra_body={"repetition_penalty": 1.0},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strange"}},
                }
            },
            "response_format",
            'Unsupported type "strange"',
        ),
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "Lookbehind"),
        (
            {"structured_outputs": {"regex": "a", "backend": "outlines"}},
            "structured_outputs.backend",
            "not supported",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "cannot be combined",
        ),
    ],
)
def test_refusals_name_field_and_construct(
    server: ServerProcess, body: dict, param: str, words: str
) -> None:
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        timeout=30,
    )
    error = assert_openai_error(response, 400, param)
    assert words in error["message"]


@pytest.mark.parametrize(
    ("template", "family"),
    [("llama3_tools.jinja", "llama3_json"), ("mistral_tools.jinja", "mistral")],
)
def test_parser_read_from_the_template(template: str, family: str) -> None:
    """With no --tool-call-parser, the family comes from the chat template: a required call
    in the Llama-3 and Mistral formats parses, streamed the same, and its result goes back."""
    proc = ServerProcess(
        "--chat-template", str(TEMPLATE.parent / template), "--num-kv-blocks", "256",
        checkpoint=str(BUNDLED_MODEL_DIR),
    )  # fmt: skip
    try:
        client = OpenAI(base_url=proc.wait_ready().url + "/v1", api_key="unused")
        request = {
            "model": client.models.list().data[0].id,
            "messages": [{"role": "user", "content": "Weather in Lima?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "temperature": 0,
            "max_tokens": 96,
        }
        message = client.chat.completions.create(**request).choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city", "unit"}
        streamed = ""
        for chunk in client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    streamed += delta.function.arguments or ""
        assert json.loads(streamed) == arguments
        follow = [
            *request["messages"],
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "20 C"},
        ]
        again = client.chat.completions.create(
            **{**request, "messages": follow, "tool_choice": "none", "max_tokens": 4}
        )
        assert again.usage.prompt_tokens > 0
    finally:
        proc.close()


def test_responses_function_tools_and_text_format(client: OpenAI, model: str) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    request = {
        "model": model,
        "input": "What is the weather in Kyiv?",
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 96,
    }
    response = client.responses.create(**request)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"}
    with client.responses.stream(**request) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in events
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(streamed.arguments) == arguments
    # The call's output goes back as an input item; the model answers in text.
    follow = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "What is the weather in Kyiv?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "5 C, rain"},
        ],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=8,
    )  # fmt: skip
    assert follow.output[0].type == "message"
    assert follow.usage.input_tokens > response.usage.input_tokens

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confidence: int = Field(ge=0, le=100)

    parsed = client.responses.parse(
        model=model, input="Yes or no?", text_format=Verdict, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Verdict)
