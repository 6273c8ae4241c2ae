"""Incremental detokenization and stop strings on streamed text.

Owner: tokenizer package.

Invariants checked: deltas never show U+FFFD for a character that later tokens complete, they
concatenate to `decode(output_ids)` however the ids are split, each step decodes a bounded
window; stop strings are found across deltas, partial matches are released when they fail,
and the result does not depend on how the text was split.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from tests.helpers.tiny_tokenizer import tokenizer_files

FFFD = "\ufffd"
PIECES = [
    "a",
    "word",
    " ",
    "   ",
    "\n",
    "\t\n  ",
    "é",
    "e\u0301",
    "ñ",
    "ß",
    "日本",
    "中文字",
    "한국어",
    "😀",
    "👩‍👩‍👧",
    "🇫🇷",
    "𝔘𝔫𝔦",
    "def ",
    "return",
    "(x)",
    "<|im_end|>",
    "</s>",
]

texts = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_files())


def byte_token_id(tok: Tokenizer, byte: int) -> int:
    """Id of the byte-level token for one raw byte (GPT-2's byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if byte in printable:
        char = chr(byte)
    else:
        char = chr(256 + [b for b in range(256) if b not in printable].index(byte))
    token_id = tok.token_to_id(char)
    assert token_id is not None
    return token_id


def split(ids: Sequence[int], cuts: Sequence[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [list(ids[a:b]) for a, b in itertools.pairwise(points)]


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = [detok.add_tokens(chunk) for chunk in chunks]
    deltas.append(detok.finish())
    return deltas


# --------------------------------------------------------------------------- detokenizer


def test_emoji_spanning_several_tokens_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀!", add_special_tokens=False)
    emoji_ids = tok.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) >= 3  # the point of the test: one character, several tokens
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    deltas = [detok.add_tokens([i]) for i in ids]
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == "ok 😀!"
    # Nothing appears while the emoji is incomplete, then all of it at once.
    emoji_deltas = [d for d in deltas if "😀" in d]
    assert emoji_deltas == ["😀"]
    assert deltas.count("") >= len(emoji_ids) - 1
    assert detok.finish() == ""
    assert detok.text == "ok 😀!"


def test_finish_flushes_an_incomplete_character(tok: Tokenizer) -> None:
    ids = [*tok.encode("x", add_special_tokens=False), byte_token_id(tok, 0xF0)]
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens(ids) == ""  # "x" waits with the dangling lead byte
    assert detok.pending_token_count == 2
    assert detok.finish() == "x" + FFFD
    assert detok.text == tok.decode(ids)
    with pytest.raises(RuntimeError):
        detok.add_tokens([1])


def test_invalid_bytes_in_the_middle_are_emitted_once_followed(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens([byte_token_id(tok, 0x80)]) == ""
    assert detok.add_tokens(tok.encode("a", add_special_tokens=False)) == FFFD + "a"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_in_output(tok: Tokenizer, skip_special_tokens: bool) -> None:
    ids = [*tok.encode("hi<|im_end|>", add_special_tokens=False), 2]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    text = "".join(stream(detok, [[i] for i in ids]))
    assert text == ("hi" if skip_special_tokens else "hi<|im_end|></s>")


def test_prompt_ending_mid_character_is_not_mixed_into_output(tok: Tokenizer) -> None:
    emoji = tok.encode("😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1, *emoji[:2]])
    out = emoji[2:] + tok.encode(" x", add_special_tokens=False)
    assert "".join(stream(detok, [out])) == tok.decode(out)


def test_each_step_decodes_a_bounded_window(tok: Tokenizer) -> None:
    class CountingTokenizer:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("streaming text 日本 😀 " * 200, add_special_tokens=False)
    assert len(ids) > 2000
    counting = CountingTokenizer()
    detok = IncrementalDetokenizer(counting, tok.encode("prompt " * 50))
    for i in ids:
        detok.add_tokens([i])
    detok.finish()
    assert detok.text == tok.decode(ids)
    assert counting.longest <= 16


@HYPOTHESIS
@given(
    text=texts,
    prompt=texts,
    cuts=st.lists(st.integers(min_value=0, max_value=500), max_size=12),
    skip=st.booleans(),
)
def test_deltas_concatenate_to_decode(
    tok: Tokenizer, text: str, prompt: str, cuts: list[int], skip: bool
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), skip_special_tokens=skip)
    deltas = stream(detok, split(ids, cuts))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.text
    assert all(FFFD not in d for d in deltas)  # valid text never shows a replacement char


@HYPOTHESIS
@given(
    ids=st.lists(st.integers(min_value=0, max_value=511), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=500), max_size=12),
)
def test_deltas_concatenate_to_decode_for_arbitrary_ids(
    tok: Tokenizer, ids: list[int], cuts: list[int]
) -> None:
    # Random ids are mostly broken UTF-8: the held-back logic must still never mis-slice.
    detok = IncrementalDetokenizer(tok, [1, 77])
    assert "".join(stream(detok, split(ids, cuts))) == tok.decode(ids)


# --------------------------------------------------------------------------- stop strings


def feed(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[list[str], bool]:
    emitted = []
    for delta in deltas:
        text, stopped = matcher.process(delta)
        emitted.append(text)
        if stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_stop_string_spanning_deltas() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.process("hello S") == ("hello ", False)
    assert matcher.held_text == "S"
    assert matcher.process("T") == ("", False)
    assert matcher.process("OP and more") == ("", True)
    assert matcher.stop_reason == "STOP"
    assert matcher.process("later") == ("", True)
    assert matcher.flush() == ""


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=True)
    emitted, stopped = feed(matcher, ["42</ans", "wer> trailing"])
    assert stopped and "".join(emitted) == "42</answer>"


def test_partial_match_that_fails_is_released() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.process("the EN") == ("the ", False)
    assert matcher.process("D") == ("", True)

    matcher = StopStringMatcher(["END"])
    assert matcher.process("the EN") == ("the ", False)
    assert matcher.process("Dless") == ("", True)

    matcher = StopStringMatcher(["END"])
    assert matcher.process("the EN") == ("the ", False)
    assert matcher.process("TRY") == ("ENTRY", False)  # released as soon as it cannot match
    assert matcher.process("E") == ("", False)
    assert matcher.flush() == "E"  # natural end: held text is output after all


def test_stop_string_that_is_a_prefix_of_another() -> None:
    # "ab" completes before "abc" can, whatever the deltas.
    for deltas in (["xabc"], ["xa", "bc"], ["x", "a", "b", "c"]):
        matcher = StopStringMatcher(["abc", "ab"], include_stop_str_in_output=True)
        emitted, stopped = feed(matcher, deltas)
        assert stopped and "".join(emitted) == "xab" and matcher.stop_reason == "ab"
    # Held text is released only once no stop string can begin there.
    matcher = StopStringMatcher(["abc", "abd"])
    assert matcher.process("xa") == ("x", False)
    assert matcher.process("b") == ("", False)
    assert matcher.process("e") == ("abe", False)


def test_earliest_match_wins() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.process("hello world") == ("hel", True)
    assert matcher.stop_reason == "lo"
    # A shorter stop inside a longer one ends first, so it wins.
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.process("xabcd") == ("xa", True)
    assert matcher.stop_reason == "bc"


def test_no_stops_pass_through() -> None:
    matcher = StopStringMatcher(["", ""])
    assert matcher.stops == ()
    assert matcher.process("anything") == ("anything", False)
    assert matcher.flush() == ""


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """What a character-by-character stream sees: the first position where a stop ends."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stops if s and text[:end].endswith(s)]
        if ending_here:
            stop = max(ending_here, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
    include=st.booleans(),
)
def test_stop_result_does_not_depend_on_split(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in itertools.pairwise(points)]
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted_so_far = ""
    for delta in deltas:
        out, stopped = matcher.process(delta)
        emitted_so_far += out
        assert text.startswith(emitted_so_far)  # never needs retraction
        assert len(matcher.held_text) <= max(len(s) for s in stops) - 1
        if stopped:
            break
    else:
        emitted_so_far += matcher.flush()
    expected_text, expected_stop = reference_stop(text, stops, include)
    assert emitted_so_far == expected_text
    assert matcher.stop_reason == expected_stop


def test_stop_strings_on_detokenized_stream(tok: Tokenizer) -> None:
    ids = tok.encode("Answer: 日本😀 done. ignored", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    matcher = StopStringMatcher(["😀 done"])
    emitted = []
    for i in ids:
        out, stopped = matcher.process(detok.add_tokens([i]))
        emitted.append(out)
        if stopped:
            break
    assert "".join(emitted) == "Answer: 日本"
