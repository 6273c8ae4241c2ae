"""Reasoning output: the `<think>` ... `</think>` part of a choice split from its answer.

Owner: server. With `--reasoning-parser` (or an Anthropic request with `thinking` enabled)
the chat routes split each choice's text into reasoning (OpenAI `reasoning_content`,
Anthropic `thinking` blocks) and content; `ReasoningStream` does the same incrementally.

Parsers (`PARSERS`): `qwen3` and `deepseek_r1` (same tags, `<think>` / `</think>`). The
reasoning starts either in the output (it opens with `<think>`) or in the prompt (the
template ended the prompt with `<think>`, as thinking templates do), and ends at the first
`</think>`; an output that never closes it is all reasoning; one that does not open it (and
whose prompt did not) is all content.

Invariants:
- Streaming and non-streaming agree: `split` is `ReasoningStream` fed the whole text, so the
  deltas concatenate to exactly `split`'s two parts.
- A suffix that could begin a tag is held back until it cannot (never sent half a tag).
"""

from __future__ import annotations

from dataclasses import dataclass

from metrale.errors import InvalidRequestError

__all__ = [
    "PARSERS",
    "THINK_END",
    "THINK_START",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]


#: The reasoning tags of every parser here.
THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = THINK_START
    end: str = THINK_END

    def starts_in_prompt(self, prompt: str) -> bool:
        """Whether the prompt opened the reasoning (ends with the start tag, less spaces)."""
        return prompt.rstrip().endswith(self.start)

    def split(self, text: str, prompt: str = "") -> tuple[str | None, str]:
        """(reasoning or None, content) of a finished output."""
        stream = ReasoningStream(self, prompt)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish(text)
        if not stream.saw_reasoning:
            return None, content + more_content
        return reasoning + more_reasoning, content + more_content


#: `--reasoning-parser` names.
PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown reasoning parser {name!r} (one of {', '.join(sorted(PARSERS))})",
            param="reasoning_parser",
        ) from None


class ReasoningStream:
    """Feed a choice's cumulative text; get (reasoning delta, content delta) each time."""

    def __init__(self, parser: ReasoningParser, prompt: str = "") -> None:
        self.parser = parser
        #: "start": not known yet; "reasoning": inside; "content": after (or never opened).
        self.phase = "reasoning" if parser.starts_in_prompt(prompt) else "start"
        self.saw_reasoning = self.phase == "reasoning"
        self.pos = 0  # characters of the text consumed
        self.skip_space = False

    def feed(self, text: str) -> tuple[str, str]:
        reasoning = content = ""
        parser = self.parser
        if self.phase == "start":
            stripped = text.lstrip()
            if stripped.startswith(parser.start):
                self.phase = "reasoning"
                self.saw_reasoning = True
                self.pos = len(text) - len(stripped) + len(parser.start)
            elif parser.start.startswith(stripped):
                return "", ""  # maybe the start tag, still arriving
            else:
                self.phase = "content"
        if self.phase == "reasoning":
            end = text.find(parser.end, self.pos)
            if end < 0:
                safe = len(text) - _tag_prefix(text, parser.end)
                reasoning, self.pos = text[self.pos : safe], max(self.pos, safe)
                return reasoning, ""
            reasoning = text[self.pos : end]
            self.pos = end + len(parser.end)
            self.phase = "content"
            self.skip_space = True  # the blank lines before the answer are not content
        if self.phase == "content":
            if self.skip_space:
                rest = text[self.pos :]
                self.pos += len(rest) - len(rest.lstrip())
                self.skip_space = self.pos >= len(text)
            content, self.pos = text[self.pos :], len(text)
        return reasoning, content

    def finish(self, text: str) -> tuple[str, str]:
        """What is left once `text` is final (a held-back partial tag), after `feed(text)`."""
        rest, self.pos = text[self.pos :], len(text)
        if self.phase == "reasoning":
            return rest, ""
        if self.phase == "start":
            self.phase = "content"
            return "", rest
        return "", "" if self.saw_reasoning and not rest.strip() else rest


def _tag_prefix(text: str, tag: str) -> int:
    """Characters at the end of `text` that could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
