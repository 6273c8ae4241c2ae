"""The engine's structured-output rows: the grammar backend, the compiles a request waits for,
each choice's matcher advanced at commit, drafts cut where the grammar refuses them, and why
a step after a grammar row cannot be fed on the device (a mixin of `Engine`; the matchers
and masks are `metrale.sampling.grammar`'s).

Owner: engine. Invariants:
- A constrained sequence is not `ready` (not admitted) until its grammar is compiled; a
  compile that fails ends its request with the error.
- A choice's matcher is synced to its sequence's output at each commit; a grammar that
  terminates ends the sequence ("stop").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from metrale.engine.output import RequestState
from metrale.sampling.grammar import GrammarBackend, GrammarState
from metrale.sampling.structured import GrammarSpec
from metrale.scheduler.core import Committed, Scheduler
from metrale.scheduler.sequence import SchedSequence
from metrale.tokenizer.tokenizer import Tokenizer


class EngineGrammar:
    """Structured-output rows of an `Engine` (see the module docstring)."""

    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: frozenset[int]
    requests: dict[str, RequestState]
    scheduler: Scheduler
    _grammars: GrammarBackend | None
    _grammar_of: dict[str, GrammarState]
    _compiling: dict[str, tuple[Future[Any], GrammarSpec]]
    host_token_drains: dict[str, int]
    grammar_drafts_cut: int

    @property
    def grammar_backend(self) -> GrammarBackend:
        """The structured-output compiler over this model's vocabulary (built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _attach_grammars(
        self, seqs: Sequence[SchedSequence], spec: GrammarSpec, compiled: Any
    ) -> None:
        for seq in seqs:
            self._grammar_of[seq.seq_id] = self.grammar_backend.state(spec, compiled)
            seq.ready = True

    @property
    def grammar_drained_steps(self) -> int:
        return self.host_token_drains.get("structured output", 0)

    def _host_token_need(self, sampled: list[SchedSequence]) -> str | None:
        """Why a step after `sampled` cannot be fed on the device, if one of its rows masks
        by tokens only the host knows: a grammar, or a bad word of several tokens."""
        if self._grammar_of and any(s.seq_id in self._grammar_of for s in sampled):
            return "structured output"
        if any(s.params.needs_known_output for s in sampled):
            return "bad words"
        return None

    def _poll_compiles(self, touched: dict[str, RequestState]) -> None:
        """Requests whose grammar finished compiling: their matchers, and admission; a
        compile that failed ends its request with the error."""
        for request_id, (future, spec) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            state = self.requests.get(request_id)
            if state is None:
                continue
            error = future.exception()
            if error is None:
                self._attach_grammars([c.seq for c in state.choices], spec, future.result())
                continue
            state.error = str(error)
            for choice in state.choices:
                self.scheduler.finish(choice.seq, "error")
                choice.close("error", None)
            touched[request_id] = state

    def _cut_drafts(self) -> None:
        """Drafts of constrained rows end before the first token their grammar refuses (the
        verifier would reject it; cutting saves its compute and KV)."""
        for seq in self.scheduler.running:
            grammar = self._grammar_of.get(seq.seq_id)
            if grammar is not None and seq.spec_token_ids:
                keep = grammar.valid_prefix(seq.output_token_ids, seq.spec_token_ids)
                if keep < len(seq.spec_token_ids):
                    self.grammar_drafts_cut += len(seq.spec_token_ids) - keep
                    del seq.spec_token_ids[keep:]

    def _advance_grammars(self, committed: list[Committed]) -> list[Committed]:
        """Advance the constrained sequences' matchers over their committed tokens (one
        batched xgrammar call for the rows one token ahead: `GrammarState.sync_many`); a
        grammar that has terminated (a stop token accepted, e.g. under `ignore_eos`) ends its
        sequence."""
        states, outputs = self._grammar_rows(committed)
        if not states:
            return committed
        GrammarState.sync_many(states, outputs)
        return self._finish_terminated(committed)

    def _advance_grammars_async(
        self, committed: list[Committed], prefill: Sequence[GrammarState]
    ) -> Future[None] | None:
        """`_advance_grammars`' matcher work on the backend's worker thread (xgrammar releases
        the GIL), then the next mask rows of `prefill`: the engine builds outputs meanwhile.
        The caller waits on the future, then calls `_finish_terminated` (main thread)."""
        states, outputs = self._grammar_rows(committed)
        if not states and not prefill:
            return None
        return self.grammar_backend.advance_async(states, outputs, prefill)

    def _grammar_rows(
        self, committed: list[Committed]
    ) -> tuple[list[GrammarState], list[list[int]]]:
        """The matchers of the constrained rows of `committed` and their outputs."""
        states, outputs = [], []
        for c in committed:
            grammar = self._grammar_of.get(c.seq.seq_id)
            if grammar is not None:
                states.append(grammar)
                outputs.append(c.seq.output_token_ids)
        return states, outputs

    def _finish_terminated(self, committed: list[Committed]) -> list[Committed]:
        """`committed` with the sequences whose grammar terminated finished ("stop")."""
        rows = [(c, self._grammar_of.get(c.seq.seq_id)) for c in committed]
        out = []
        for c, grammar in rows:
            if grammar is not None and grammar.terminated and not c.seq.is_finished:
                self.scheduler.finish(c.seq, "stop")
                c = dataclasses.replace(c, finished=True)
            out.append(c)
        return out
