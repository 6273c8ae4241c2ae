"""Incremental detokenization: the text delta that each batch of new output tokens adds.

Owner: tokenizer package. The engine keeps one `IncrementalDetokenizer` per output sequence and
calls `add_tokens` as tokens are sampled, `finish` once when the sequence ends.

Invariants:
- A delta never contains a U+FFFD produced by a UTF-8 sequence that later tokens complete: text
  whose decoding ends in U+FFFD is held back until it decodes cleanly, or until `finish`.
- Emitted text is never retracted: the concatenated deltas are always a prefix of the final
  text, and after `finish` they are the whole of it, which is `tokenizer.decode(output_ids)`
  whenever decoding is concatenative at character boundaries (byte-level BPE, WordPiece-free
  decoders). With a SentencePiece-style decoder that drops the first token's leading space,
  the prompt's last tokens serve as context (as in vLLM), so the output keeps the space that
  separates it from the prompt.
- Work per call is proportional to the tokens added plus a small window (the tokens since the
  last emitted character boundary and a few before it), never to the sequence length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

# How many prompt tokens precede the output as decoding context (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The part of `metrale.tokenizer.Tokenizer` the detokenizer needs."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    The ids live in one list: an optional prompt context, then the output. Two offsets index it:
    `prefix` is where the decoding window starts and `read` is the end of what has already been
    emitted. Each step decodes `[prefix, read)` and `[prefix, end)`; the delta is the part of
    the second beyond the first. Decoding a few tokens before `read` makes tokenizers whose
    decoding of a token depends on its left neighbour (leading-space rules) come out right.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (or in invalid bytes): decoding the output
            # against it would mix prompt bytes into the output's first character.
            context = []
        self._ids: list[int] = context
        self._context_len = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []
        self._finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        """The output ids added so far (a copy)."""
        return self._ids[self._context_len :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def pending_token_count(self) -> int:
        """Output tokens whose text is held back because it ends inside a character."""
        return len(self._ids) - self._read_offset

    @property
    def finished(self) -> bool:
        return self._finished

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids` to the output and return the text they complete (maybe "")."""
        if self._finished:
            raise RuntimeError("add_tokens called after finish()")
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._step(final=False)

    def finish(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD) and close."""
        if self._finished:
            return ""
        delta = self._step(final=True) if self.pending_token_count else ""
        self._finished = True
        return delta

    def _step(self, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        read_in_window = self._read_offset - self._prefix_offset
        new_text = self._decode(window)
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""  # hold: the last character may still be completed by later tokens
        prefix_text = self._decode(window[:read_in_window]) if read_in_window else ""
        delta = new_text[len(prefix_text) :]
        if delta:
            self._prefix_offset = self._read_offset
            self._pieces.append(delta)
        # With no text yet (e.g. skipped special tokens) keep the window's start, so that the
        # next word is still decoded after a real left neighbour.
        elif len(window) > 4 * PROMPT_CONTEXT_TOKENS:
            self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
