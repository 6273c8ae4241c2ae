"""One chat request's output features: tools, tool choice, reasoning and output constraint,
decided once from the body and applied to the prompt, the sampling and the answer.

Owner: server. `ChatOutputPlan` is built by the chat and messages routes from the request
(`openai_plan`, `anthropic_plan`) and the server's flags (`--tool-call-parser`,
`--reasoning-parser`): it says what the chat template gets (`tools`, `enable_thinking`),
which grammar constrains the output (a tool-call structural tag for `required` / named
tools, else the request's `response_format` / `structured_outputs` / `guided_*` /
`output_config.format`), and turns each finished choice into (reasoning, content, tool calls)
or, streaming, a `ChoiceSplitter` into deltas of the same.

Invariants:
- A constrained tool choice and a response format together are a 400 (one grammar only).
- The reasoning split runs first, the tool-call parse on the content after it, in both the
  streaming and the finished paths, so the streamed deltas concatenate to the finished parts.
- With no tools, no reasoning parser and no constraint the plan changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.sampling.params import SamplingParams
from metrale.sampling.structured import GrammarSpec
from metrale.server.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from metrale.server.structured import (
    anthropic_output_format,
    request_grammar,
    responses_text_format,
)
from metrale.server.tool_parsers import ToolCallStream, ToolParser, detect_parser, get_parser
from metrale.server.tools import (
    ToolCall,
    ToolChoice,
    anthropic_tool_choice,
    anthropic_tools,
    normalize_tool_choice,
    normalize_tools,
    responses_tool_choice,
    responses_tools,
)
from metrale.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatOutputPlan",
    "ChoiceParts",
    "ChoiceSplitter",
    "anthropic_plan",
    "openai_plan",
    "responses_plan",
]

logger = logging.getLogger(__name__)


@dataclass
class ChoiceParts:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChatOutputPlan:
    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    grammar: GrammarSpec | None = None
    #: Extra chat-template variables (`enable_thinking`).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Anthropic `thinking.budget_tokens` (enabled thinking): the route's reasoning phase.
    thinking_budget: int | None = None

    def answer_plan(self) -> ChatOutputPlan:
        """The plan of the answer after a budgeted reasoning phase (no reasoning split)."""
        if self.thinking_budget is None:
            return self
        return dataclasses.replace(self, reasoning=None, thinking_budget=None)

    @property
    def parses_tools(self) -> bool:
        return self.parser is not None and self.choice.mode != "none"

    def template_args(self) -> dict[str, Any]:
        """What the chat template gets besides the messages."""
        args = dict(self.template_kwargs)
        if self.tools:
            args["tools"] = self.tools
        return args

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with the plan's grammar (and special tokens kept for a parser that needs
        them in the text)."""
        changes: dict[str, Any] = {}
        if self.grammar is not None:
            changes["structured_outputs"] = self.grammar
        if self.parses_tools and self.parser is not None and self.parser.name == "mistral":
            changes["skip_special_tokens"] = False  # [TOOL_CALLS] is a special token there
        return params.replace(**changes) if changes else params

    def parts(self, text: str, prompt: str) -> ChoiceParts:
        """(reasoning, content, tool calls) of a finished choice."""
        reasoning: str | None = None
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, prompt)
        if not self.parses_tools or self.parser is None:
            return ChoiceParts(reasoning, content)
        content, calls = self.parser.extract(content)
        return ChoiceParts(reasoning, content, calls)

    def splitter(self, prompt: str) -> ChoiceSplitter:
        return ChoiceSplitter(self, prompt)


class ChoiceSplitter:
    """Streaming: feed a choice's cumulative text, get (reasoning, content, new calls) deltas."""

    def __init__(self, plan: ChatOutputPlan, prompt: str) -> None:
        self.reasoning = (
            ReasoningStream(plan.reasoning, prompt) if plan.reasoning is not None else None
        )
        self.tools = ToolCallStream(plan.parser) if plan.parses_tools and plan.parser else None
        self.content = ""  # content after the reasoning split, cumulative
        self.sent = 0  # content characters released (without a tool parser)

    def feed(self, text: str, final: bool = False) -> ChoiceParts:
        reasoning = ""
        if self.reasoning is None:
            self.content = text
        else:
            r, c = self.reasoning.feed(text)
            reasoning, self.content = r, self.content + c
            if final:
                r, c = self.reasoning.finish(text)
                reasoning, self.content = reasoning + r, self.content + c
        if self.tools is None:
            delta, self.sent = self.content[self.sent :], len(self.content)
            return ChoiceParts(reasoning, delta)
        if final:
            content, calls = self.tools.feed(self.content)
            more, rest = self.tools.finish(self.content)
            return ChoiceParts(reasoning, content + more, calls + rest)
        content, calls = self.tools.feed(self.content)
        return ChoiceParts(reasoning, content, calls)


def _server_parsers(
    tool_call_parser: str | None, reasoning_parser: str | None, tokenizer: Tokenizer
) -> tuple[ToolParser, ReasoningParser | None]:
    parser = (
        get_parser(tool_call_parser) if tool_call_parser else detect_parser(tokenizer.chat_template)
    )
    reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
    return parser, reasoning


def _thinking_parser(reasoning: ReasoningParser | None) -> ReasoningParser:
    """The reasoning split of a request that turns thinking on: the server's parser, else the
    `<think>` tags (the qwen3 parser)."""
    return reasoning or get_reasoning_parser("qwen3")


def openai_plan(
    req: Any,
    tokenizer: Tokenizer,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> ChatOutputPlan:
    """The plan of an OpenAI chat body (`tools`, `tool_choice`, `parallel_tool_calls`,
    `response_format`, vLLM's constraint fields, `chat_template_kwargs.enable_thinking`)."""
    template = getattr(req, "chat_template", None)  # a per-request template names the family
    if (
        template is not None
        and not tool_call_parser
        and template not in tokenizer.chat_template_names
    ):
        tool_call_parser = detect_parser(template).name
    parser, reasoning = _server_parsers(tool_call_parser, reasoning_parser, tokenizer)
    extra = getattr(req, "model_extra", None) or {}
    tools = normalize_tools(getattr(req, "tools", None))
    parallel = getattr(req, "parallel_tool_calls", extra.get("parallel_tool_calls"))
    choice = normalize_tool_choice(getattr(req, "tool_choice", None), tools, parallel)
    grammar = request_grammar(req)
    return _finish_plan(tools, choice, parser, reasoning, grammar, {}, "response_format")


def responses_plan(
    req: Any,
    tokenizer: Tokenizer,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> ChatOutputPlan:
    """The plan of a Responses body (`tools`, `tool_choice`, `parallel_tool_calls`,
    `text.format`, `reasoning`). `reasoning.effort` low / medium / high turns on
    `enable_thinking` and the reasoning split (the server's parser, else the `<think>` tags),
    so the thinking comes back as a `reasoning` item; "minimal" / "none" turn it off."""
    parser, reasoning = _server_parsers(tool_call_parser, reasoning_parser, tokenizer)
    extra = getattr(req, "model_extra", None) or {}
    tools = responses_tools(req.tools)
    choice = responses_tool_choice(req.tool_choice, tools, extra.get("parallel_tool_calls"))
    grammar = responses_text_format(req.text)
    kwargs: dict[str, Any] = {}
    effort = (req.reasoning or {}).get("effort") if isinstance(req.reasoning, dict) else None
    if effort in ("low", "medium", "high"):
        kwargs["enable_thinking"] = True
        reasoning = _thinking_parser(reasoning)
    elif effort in ("minimal", "none"):
        kwargs["enable_thinking"] = False
    elif effort is not None:
        raise InvalidRequestError(
            f"reasoning.effort must be one of none, minimal, low, medium, high; got {effort!r}",
            param="reasoning.effort",
        )
    return _finish_plan(tools, choice, parser, reasoning, grammar, kwargs, "text.format")


def anthropic_plan(
    req: Any,
    tokenizer: Tokenizer,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    generating: bool = True,
) -> ChatOutputPlan:
    """The plan of an Anthropic messages body (`tools`, `tool_choice`, `thinking`,
    `output_config.format`). Enabled `thinking` turns on `enable_thinking` in the template
    and the reasoning split (the server's parser, else the `<think>` tags). `generating`
    False (`count_tokens`): the budget is not checked against `max_tokens`."""
    parser, reasoning = _server_parsers(tool_call_parser, reasoning_parser, tokenizer)
    tools = anthropic_tools(req.tools)
    choice = anthropic_tool_choice(req.tool_choice, tools)
    thinking = req.thinking if isinstance(req.thinking, dict) else None
    kwargs: dict[str, Any] = {}
    budget: int | None = None
    if thinking is not None and thinking.get("type") == "enabled":
        kwargs["enable_thinking"] = True
        reasoning = _thinking_parser(reasoning)
        budget = int(thinking["budget_tokens"])
        if generating and budget >= req.max_tokens:
            raise InvalidRequestError(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                f"({req.max_tokens})",
                param="thinking.budget_tokens",
            )
    elif thinking is not None and thinking.get("type") == "disabled":
        kwargs["enable_thinking"] = False
        reasoning = None
    grammar = anthropic_output_format(req.output_config)
    plan = _finish_plan(tools, choice, parser, reasoning, grammar, kwargs, "output_config.format")
    plan.thinking_budget = budget
    return plan


def _finish_plan(
    tools: list[dict[str, Any]],
    choice: ToolChoice,
    parser: ToolParser,
    reasoning: ReasoningParser | None,
    grammar: GrammarSpec | None,
    kwargs: dict[str, Any],
    format_param: str,
) -> ChatOutputPlan:
    if choice.constrained:
        if grammar is not None:
            raise InvalidRequestError(
                f"{format_param} cannot be combined with a required or named tool_choice "
                "(both constrain the output)",
                param=format_param,
            )
        if reasoning is not None:
            logger.info("a required tool call is constrained from the first token: no reasoning")
            reasoning = None
        grammar = parser.grammar(tools, choice)
    return ChatOutputPlan(
        tools=tools,
        choice=choice,
        parser=parser if tools else None,
        reasoning=reasoning,
        grammar=grammar,
        template_kwargs=kwargs,
    )
