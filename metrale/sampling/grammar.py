"""Grammar-constrained sampling with xgrammar: compiled grammars, per-sequence matchers, masks.

Owner: sampling. `GrammarBackend` (one per engine) turns a `GrammarSpec` into an xgrammar
`CompiledGrammar` over the model's vocabulary (a `TokenizerInfo` built from our `Tokenizer`)
and caches it by the spec's key; `GrammarState` (one per sequence) is a matcher that follows
the sequence's accepted tokens and fills bitmask rows; the step's bitmask (sent to the
device and applied there) is `grammar_mask`'s, its rows `grammar_rows`'s.

Invariants:
- A `GrammarState`'s matcher has accepted exactly the sequence's output tokens: `sync(tokens)`
  keeps what the last synced list shares with `tokens`, rolls the matcher back over the rest
  (rejected drafts) and accepts the new tokens. It is idempotent, so recompute preemption
  (the output kept, the KV recomputed) and prefix caching (which changes no output token)
  never advance it twice.
- Speculative decoding: `valid_prefix` cuts a row's drafts at the first token the grammar
  refuses (the engine does, before planning); a verify row's positions are masked in order,
  position j after the output plus drafts 0..j-1, so the target distribution at every
  position is the constrained one and verification stays lossless.
- A token the grammar rejects (only possible for a token the mask did not choose: the
  sampler's fallback for a row with nothing samplable) marks the state `failed`: its rows
  then allow nothing, so the row is reported unsamplable and the engine ends that request
  with an error; the batch never fails.
- JSON grammars (`json_schema`, `json_object`) are compact (no whitespace beyond one space
  after ':' and ','), and their rows also forbid every token holding a control character
  (U+0000-U+001F): xgrammar's string rules let raw ones through, which strict JSON parsers
  (Python's, pydantic's) refuse; escaped forms stay allowed, so no JSON value is lost.
- After the grammar's end (`terminated`: a stop token accepted) a row allows only the stop
  tokens; the engine finishes the sequence with reason "stop" when its matcher terminates.
- A step's live rows are filled in one call of xgrammar's `BatchGrammarMatcher` (its own
  threads, without the GIL), while the step's forward computes on CUDA. `advance_async` (the
  matchers' batched accept, then the next rows, in chunks of rows on worker threads:
  `grammar_advance`) runs while the engine's main thread waits for it (the engine builds
  earlier steps' outputs after the sampler is queued); a prefilled row is used only while
  its state stays at the position (synced-list version, accepted count, termination) it was
  filled at, else the row is filled afresh.
- A state's `_terminated` is the matcher's `is_terminated()` as of its last accept or
  rollback (both go through `sync`, `sync_many` or `valid_prefix`, which restores it), so
  the per-step checks on the main thread (`live`, `failed`, the prefilled row's position)
  make no call into xgrammar.
- Compiled off the step: `submit` parses the spec at once (a spec xgrammar refuses raises
  `InvalidRequestError` naming the request field and xgrammar's reason, the construct, before
  the request is queued) and compiles it over the vocabulary on a worker thread (xgrammar
  releases the GIL), cached by the spec's text; the engine admits the request once it is done.
- xgrammar is imported when the first backend is built, so a server that never constrains
  output does not need it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from metrale.errors import InvalidRequestError, MetraleError
from metrale.sampling.grammar_advance import advance_in_chunks
from metrale.sampling.grammar_mask import MaskStaging, apply_grammar_masks, bitmask_words
from metrale.sampling.structured import GrammarSpec

if TYPE_CHECKING:
    from metrale.tokenizer.tokenizer import Tokenizer

__all__ = ["GrammarBackend", "GrammarState", "apply_grammar_masks", "bitmask_words"]

logger = logging.getLogger(__name__)

#: Special tokens that keep their text for the grammar: tool-call formats write them (Mistral's
#: `[TOOL_CALLS]` is one special token; the grammar's "[TOOL_CALLS][" then matches it).
TOOL_CALL_MARKERS = frozenset({"[TOOL_CALLS]", "<tool_call>", "</tool_call>", "<|python_tag|>"})
#: Compiled grammars kept per backend (least recently used dropped first).
COMPILE_CACHE_ENTRIES = 256
#: Threads xgrammar's batch matcher fills a step's bitmask rows on.
BATCH_FILL_THREADS = 8
#: Chunks of rows (worker threads) a step's matcher advance and prefill split over.
ADVANCE_CHUNKS = 4
#: The C++ location xgrammar puts in front of its messages ("[17:06:23] /path/x.cc:94: ").
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def _vocab_type(backend_json: str) -> tuple[str, bool]:
    """(xgrammar vocab type name, add_prefix_space) read from a `tokenizer.json`'s decoder."""
    data = json.loads(backend_json)
    decoder = data.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {part.get("type") for part in parts if isinstance(part, dict)}
    if "ByteLevel" in types:
        return "BYTE_LEVEL", False
    if "ByteFallback" in types:
        prefix = any(
            part.get("type") == "Metaspace" and part.get("prepend_scheme", "always") != "never"
            for part in parts
            if isinstance(part, dict)
        )
        return "BYTE_FALLBACK", prefix
    return "RAW", False


class GrammarBackend:
    """xgrammar's compiler over one model's vocabulary, with a compile cache by spec."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Collection[int]
    ) -> None:
        try:
            import xgrammar as xgr
        except ImportError as exc:  # the server extra brings it
            raise InvalidRequestError(
                "structured output needs the xgrammar package (pip install 'metrale[server]')",
                param="response_format",
            ) from exc
        self._xgr = xgr
        self.vocab_size = vocab_size
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        stops = set(stop_token_ids)
        special = set(tokenizer.all_special_ids)
        for token, index in vocab.items():
            # Special tokens (other than the stops and the tool-call markers) get no text:
            # xgrammar then never allows them inside the grammar's strings, where they would
            # decode to nothing.
            if index < vocab_size and (
                index not in special or index in stops or token in TOOL_CALL_MARKERS
            ):
                encoded[index] = token
        kind, prefix = _vocab_type(tokenizer.backend.to_str())
        self.stop_token_ids = sorted(t for t in stops if t < vocab_size)
        if not self.stop_token_ids:
            raise MetraleError("structured output needs a stop (EOS) token in the vocabulary")
        self.info = xgr.TokenizerInfo(
            encoded,
            getattr(xgr.VocabType, kind),
            vocab_size=vocab_size,
            stop_token_ids=self.stop_token_ids,
            add_prefix_space=prefix,
        )
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        #: Compiles by spec key: done futures are the cache, pending ones are shared by
        #: requests with the same spec.
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrale-grammar")
        #: Advances matchers and fills bitmasks ahead of a sample (`advance_async`), apart
        #: from the compiles: one thread and one batch matcher per chunk of rows.
        self._fill_executor = ThreadPoolExecutor(
            max_workers=ADVANCE_CHUNKS, thread_name_prefix="metrale-grammar-fill"
        )
        self._no_control: Tensor | None = None
        #: Fills several rows' bitmasks at once on C++ threads (the GIL released).
        threads = max(1, min(BATCH_FILL_THREADS, os.cpu_count() or 1))
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        per_chunk = max(1, threads // ADVANCE_CHUNKS)
        self._chunk_batches = [
            xgr.BatchGrammarMatcher(max_threads=per_chunk) for _ in range(ADVANCE_CHUNKS)
        ]
        #: The host side of every step's mask upload (`apply_grammar_masks`).
        self._staging = MaskStaging()
        #: Compiles done and cache hits (tests and logs).
        self.compiles = 0
        self.cache_hits = 0
        logger.info(
            "structured output: xgrammar over %d tokens (%s vocabulary, stop ids %s)",
            vocab_size,
            kind.lower(),
            self.stop_token_ids,
        )

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """The compile of `spec`, started on the backend's worker thread (xgrammar releases
        the GIL there) or found in the cache. The spec is parsed first, here: a construct
        xgrammar refuses raises `InvalidRequestError` at once. The future's result is the
        compiled grammar; a compile that fails after parsing holds that error."""
        future = self._cache.get(spec.key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(spec.key)
            self.cache_hits += 1
            return future
        grammar = self._guard(spec, lambda: self._parse(spec))
        future = self._executor.submit(self._guard, spec, lambda: self._compile(spec, grammar))
        self.compiles += 1
        self._cache[spec.key] = future
        while len(self._cache) > COMPILE_CACHE_ENTRIES:
            oldest = next(iter(self._cache))
            if not self._cache[oldest].done():
                break  # never drop a compile someone waits for
            del self._cache[oldest]
        return future

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (cached), waiting for it; `InvalidRequestError`
        if xgrammar refuses it."""
        return self.submit(spec).result()

    @staticmethod
    def _guard(spec: GrammarSpec, work: Any) -> Any:
        """`work()`, with xgrammar's refusals as `InvalidRequestError` naming the field."""
        try:
            return work()
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar reports every refusal as RuntimeError/ValueError
            reason = _XGRAMMAR_PREFIX.sub("", str(exc)).strip().splitlines()[0]
            raise InvalidRequestError(
                f"{spec.param}: the {spec.kind.replace('_', ' ')} is not supported: {reason}",
                param=spec.param,
            ) from None

    def _parse(self, spec: GrammarSpec) -> Any:
        """The tokenizer-independent grammar of `spec` (fast; the compile is the slow part)."""
        grammar = self._xgr.Grammar
        if spec.kind == "json_schema":
            return grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return grammar.from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return grammar.from_ebnf(ebnf)
        if spec.kind == "grammar":
            return grammar.from_ebnf(spec.value)
        if spec.kind == "structural_tag":
            return grammar.from_structural_tag(spec.value)
        raise InvalidRequestError(f"unknown constraint kind {spec.kind!r}", param=spec.param)

    def _compile(self, spec: GrammarSpec, grammar: Any) -> Any:
        return self._compiler.compile_grammar(grammar)

    def state(self, spec: GrammarSpec, compiled: Any = None) -> GrammarState:
        """A fresh matcher for one sequence constrained by `spec` (`compiled`: its compiled
        grammar, when the caller has it already)."""
        matcher = self._xgr.GrammarMatcher(compiled if compiled is not None else self.compile(spec))
        extra = self.no_control_row() if spec.kind in ("json_schema", "json_object") else None
        return GrammarState(matcher, self.stop_token_ids, extra, self._batch, self._staging)

    def advance_async(
        self,
        states: Sequence[GrammarState],
        outputs: Sequence[Sequence[int]],
        prefill: Sequence[GrammarState],
    ) -> Future[None]:
        """`GrammarState.sync_many(states, outputs)`, then `prefill`'s next rows filled ahead,
        on the fill worker threads in chunks of rows (`grammar_advance`); wait on the future
        before touching any of them."""
        return advance_in_chunks(
            self._fill_executor, self._chunk_batches, states, outputs, prefill,
            bitmask_words(self.vocab_size),
        )  # fmt: skip

    def no_control_row(self) -> Tensor:
        """A bitmask row (int32 words) allowing every token without a control character."""
        if self._no_control is None:
            row = torch.full((bitmask_words(self.vocab_size),), -1, dtype=torch.int32)
            for token, raw in enumerate(self.info.decoded_vocab[: self.vocab_size]):
                if any(b < 0x20 for b in raw):
                    row[token // 32] &= ~_bit(token % 32)
            self._no_control = row
        return self._no_control


class GrammarState:
    """One sequence's matcher, kept equal to its output tokens (see the module invariants)."""

    def __init__(
        self,
        matcher: Any,
        stop_token_ids: Sequence[int],
        extra_mask: Tensor | None = None,
        batch: Any = None,
        staging: MaskStaging | None = None,
    ) -> None:
        self._matcher = matcher
        #: `matcher.is_terminated()` as of the last accept or rollback (kept here: the mask
        #: and position checks of every step read it without a call into xgrammar).
        self._terminated = bool(matcher.is_terminated())
        self._batch = batch
        #: The backend's mask upload buffers (None: a fresh tensor per mask).
        self.staging = staging
        #: A bitmask row ANDed into every fill (JSON grammars: no control characters).
        self._extra_mask = extra_mask
        self._stop_token_ids = list(stop_token_ids)
        #: The tokens last synced to, and how many of them (a prefix) the matcher accepted:
        #: fewer than all when one was rejected (`failed`) or came after the grammar's end.
        self._view: list[int] = []
        self._accepted = 0
        #: Where the synced list's drafts begin (a verify position's `committed`), if any.
        self._drafts_from: int | None = None
        #: Tokens given back to the matcher (`sync` to a list that diverged: rejected drafts).
        self.rollbacks = 0
        #: Bumped whenever the synced list changes (a prefilled row's validity).
        self._version = 0
        #: A bitmask row filled ahead (`grammar_rows.prefill_rows`): the position it is valid
        #: at, the block of rows it was filled in and its row there.
        self._prefilled: tuple[tuple[int, int, bool], Tensor, int] | None = None
        #: Rows taken from a prefill instead of filled at sample time (tests, metrics).
        self.prefill_hits = 0

    @property
    def num_seen(self) -> int:
        return len(self._view)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self._terminated

    @property
    def failed(self) -> bool:
        """A token of the synced list was rejected by the grammar."""
        return self._accepted < len(self._view) and not self._terminated

    @property
    def live(self) -> bool:
        """Neither failed nor terminated: its next tokens come from the grammar."""
        return self._accepted == len(self._view) and not self._terminated

    def sync(self, tokens: Sequence[int], committed: int | None = None) -> None:
        """Make the matcher have accepted exactly `tokens` (up to a rejected token or the
        grammar's end): the part shared with the last synced list stays, the rest is rolled
        back and the new tokens accepted. `committed` (a verify position): the tokens from
        there on are drafts, which the next sync may find replaced.

        A sequence's output only grows, so the last synced list is a prefix of `tokens`
        except where it held drafts: only that tail (or the last token) is compared, and
        appending costs the new tokens alone, whatever the output's length."""
        view = self._view
        if (  # already synced (the engine's steady step: its worker thread synced it)
            committed is None
            and self._drafts_from is None
            and len(tokens) == len(view)
            and (not view or tokens[-1] == view[-1])
            and self._accepted == len(view)
        ):
            return
        trusted = self._drafts_from if self._drafts_from is not None else len(view) - 1
        common = max(0, min(trusted, len(tokens), len(view)))
        while common < len(view) and common < len(tokens) and view[common] == tokens[common]:
            common += 1
        if common < len(view) or len(tokens) > common:
            self._version += 1  # the synced list changed: a prefilled row is stale
        del view[common:]
        self._drafts_from = committed
        if common < self._accepted:
            self._matcher.rollback(self._accepted - common)
            self.rollbacks += self._accepted - common
            self._accepted = common
            self._terminated = bool(self._matcher.is_terminated())
        view.extend(int(t) for t in tokens[len(view) :])
        matcher = self._matcher
        while (
            self._accepted < len(view)
            and not self._terminated
            and matcher.accept_token(view[self._accepted])
        ):
            self._accepted += 1
            self._terminated = bool(matcher.is_terminated())

    @staticmethod
    def sync_many(states: Sequence[GrammarState], outputs: Sequence[Sequence[int]]) -> None:
        """`states[j].sync(outputs[j])` for every j (each state once). A state whose synced list
        is draft-free, fully accepted and one token short of its output (a decode step's
        commit) takes that token in one batched xgrammar call for all such states; the others
        sync one by one. The same result as syncing each: the token is accepted, or the state
        is left failed at it, exactly as `sync` leaves it."""
        batch_states: list[GrammarState] = []
        tokens: list[int] = []
        for state, output in zip(states, outputs, strict=True):
            view = state._view
            if (
                state._batch is not None
                and state._drafts_from is None
                and len(output) == len(view) + 1
                and state._accepted == len(view)
                and (not view or output[len(view) - 1] == view[-1])
                and not state._terminated
            ):
                batch_states.append(state)
                tokens.append(int(output[-1]))
            else:
                state.sync(output)
        if not batch_states:
            return
        accepted = batch_states[0]._batch.batch_accept_token(
            [state._matcher for state in batch_states], tokens
        )
        for state, token, ok in zip(batch_states, tokens, accepted, strict=True):
            state._version += 1  # the synced list changed: a prefilled row is stale
            state._view.append(token)
            if ok:
                state._accepted += 1
                state._terminated = bool(state._matcher.is_terminated())

    def valid_prefix(self, output: Sequence[int], drafts: Sequence[int]) -> int:
        """How many leading `drafts` the grammar allows after `output` (tried, then given
        back: the matcher ends synced to `output`)."""
        self.sync(output)
        if not self.live:
            return 0
        count = 0
        for token in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                break
            count += 1
        if count:
            self._matcher.rollback(count)
        return count

    def _position(self) -> tuple[int, int, bool]:
        """What a fill depends on: the synced list (its version), how much of it the matcher
        accepted, and termination."""
        return self._version, self._accepted, self._terminated

    def fill(self, bitmask: Tensor, row: int, committed: int | None = None) -> None:
        """Write this sequence's allowed next tokens into `bitmask[row]` (CPU int32).
        `committed`: how many synced tokens are the sequence's own (the rest are drafts
        being verified): after a rejected draft the row allows everything, since the
        verifier rejects that draft and drops this position anyway."""
        if self.failed:
            if committed is not None and self._accepted >= committed:
                bitmask[row].fill_(-1)
            else:
                bitmask[row].zero_()
        elif self._terminated:
            bitmask[row].zero_()
            for token in self._stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
            if self._extra_mask is not None:
                bitmask[row] &= self._extra_mask


def _bit(position: int) -> int:
    """The int32 value with only bit `position` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position
