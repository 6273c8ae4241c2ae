"""The bundled `metrale-tiny-code` with its generation_config.json defaults writes recognisable
Python: greedy "def fibonacci(n):\\n" for 96 tokens parses (as complete lines) for at least 4
non-empty lines and repeats no line more than 3 times.

Owner: tests (engine). Calibrated on the shipped weights: with the checkpoint's
`repetition_penalty` 1.2 the completion is a docstring, an `if`/`raise`, comments and a
`try`/`except`; overridden to plain greedy (1.0) it is an unterminated docstring that loops
("use random() to use random() to ..."), which the second test pins down so that the first one
is known to be able to fail.
"""

from __future__ import annotations

import ast
from collections import Counter

import pytest

from metrale import LLM

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 96
MIN_PARSED_LINES = 4
MAX_LINE_REPEATS = 3


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def _with_pass(source: str) -> str:
    """`source` plus an indented `pass` when its last non-empty line opens a block."""
    last = next((line for line in reversed(source.splitlines()) if line.strip()), "")
    if not last.rstrip().endswith(":"):
        return source
    indent = last[: len(last) - len(last.lstrip())]
    return source + indent + "    pass\n"


def parsed_prefix(completion: str) -> list[str]:
    """The longest run of the completion's complete lines (from its start) that, after PROMPT,
    parses: as it is, or with an indented `pass` closing an open block."""
    complete = completion.split("\n")[:-1]  # the text after the last newline is cut off
    for cut in range(len(complete), -1, -1):
        source = PROMPT + "".join(line + "\n" for line in complete[:cut])
        if _parses(source) or _parses(_with_pass(source)):
            return complete[:cut]
    return []


def quality_problems(completion: str) -> list[str]:
    """Why `completion` is not recognisable Python (empty when it is)."""
    problems = []
    parsed = [line for line in parsed_prefix(completion) if line.strip()]
    if len(parsed) < MIN_PARSED_LINES:
        problems.append(
            f"only {len(parsed)} non-empty lines parse (at least {MIN_PARSED_LINES} wanted)"
        )
    counts = Counter(line.strip() for line in completion.split("\n") if line.strip())
    line, count = counts.most_common(1)[0] if counts else ("", 0)
    if count > MAX_LINE_REPEATS:
        problems.append(f"the line {line!r} occurs {count} times (at most {MAX_LINE_REPEATS})")
    return problems


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32")


def _greedy(llm: LLM, **overrides: object) -> str:
    params = llm.get_default_sampling_params().replace(
        temperature=0, max_tokens=MAX_TOKENS, **overrides
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert len(out.token_ids) == MAX_TOKENS, out.finish_reason
    return out.text


def test_bundled_model_writes_python_with_its_defaults(llm: LLM) -> None:
    assert llm.get_default_sampling_params().repetition_penalty == 1.2
    completion = _greedy(llm)
    problems = quality_problems(completion)
    assert not problems, f"{'; '.join(problems)} in the completion:\n{PROMPT}{completion}"


def test_plain_greedy_fails_the_check(llm: LLM) -> None:
    """Without the repetition penalty the model loops: the check above would fail."""
    completion = _greedy(llm, repetition_penalty=1.0)
    assert quality_problems(completion), f"plain greedy passed:\n{PROMPT}{completion}"
