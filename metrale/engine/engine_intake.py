"""The engine's intake: a request validated and queued (`add_request`), its prompt checked
alone (`check_prompt`), and a request ended wherever it is (`abort_request`) (a mixin of
`Engine`).

Owner: engine. Invariants:
- `add_request` raises before changing anything if the request is bad (its prompt, its
  sampling parameters, its adapter, images or grammar): nothing is queued, no id is taken.
- A request's choices are all in the scheduler or none is (a failed add finishes the ones
  added, "abort").
- `abort_request` releases what the request held: its sequences end in the scheduler, its
  choices close, and its grammar matchers, compile and speculation state go.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from metrale.engine.intake import DEFAULT_TENANT, bad_word_ids, check_request
from metrale.engine.output import ChoiceState, RequestState
from metrale.engine.request import RequestOutput
from metrale.engine.vision import check_vision
from metrale.errors import InvalidRequestError
from metrale.sampling.params import SamplingParams, derive_choice_seed
from metrale.scheduler.sequence import SchedSequence

if TYPE_CHECKING:
    from metrale.config import EngineConfig
    from metrale.engine.speculation import Speculation
    from metrale.sampling.grammar import GrammarBackend, GrammarState
    from metrale.sampling.structured import GrammarSpec
    from metrale.scheduler.core import Scheduler
    from metrale.tokenizer.tokenizer import Tokenizer


class EngineIntake:
    """Requests in and out of an `Engine` (see the module docstring)."""

    config: EngineConfig
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    vision: Any
    requests: dict[str, RequestState]
    scheduler: Scheduler
    speculation: Speculation
    grammar_backend: GrammarBackend
    _grammar_of: dict[str, GrammarState]
    _compiling: dict[str, tuple[Future[Any], GrammarSpec]]
    _choice_of: dict[str, tuple[RequestState, ChoiceState]]

    # The other parts of `Engine` this one calls (annotations only: nothing is shadowed).
    default_sampling_params: Callable[[], SamplingParams]
    _check_adapter: Callable[[int], None]
    _attach_grammars: Callable[[Sequence[SchedSequence], GrammarSpec, Any], None]

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        adapter_id: int = 0,
        final_only: bool = False,
        speculative: bool = True,
        lookup_tenant: str | None = DEFAULT_TENANT,
        cache_namespace: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        vision: Any = None,
    ) -> None:
        """Validate and queue a request; raises before changing anything if it is bad.

        `final_only`: `step` returns this request's output once, when it finishes (vLLM's
        `RequestOutputKind.FINAL_ONLY`: offline callers skip building an output per token).
        `speculative=False` opts this request out of speculative decoding; `lookup_tenant`
        partitions the cross-request draft lookup (None: this request neither feeds nor
        reads it); `cache_namespace` (a tenant and/or `cache_salt`) keeps the request's
        prefix-cache blocks apart from every other namespace's; `priority` orders the queues
        under `scheduling_policy="priority"` (lower first); `session_id` names the
        conversation the request continues (hybrid models keep its SSM snapshots); `vision` (a
        `VisionInputs` from `self.vision.build`) carries the prompt's images."""
        params = params or self.default_sampling_params()
        if adapter_id:
            self._check_adapter(adapter_id)
            if lookup_tenant is not None:  # an adapter's drafts never feed another's lookups
                lookup_tenant = f"{lookup_tenant}/lora:{adapter_id}"
        if request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use", param="request_id"
            )
        text, ids, max_tokens = self.check_prompt(prompt, prompt_token_ids, params)
        if vision is not None or self.vision is not None:
            check_vision(vision, ids, self.vision)
        if params.bad_words:
            params = params.replace(bad_words_token_ids=bad_word_ids(params, self.tokenizer))
        spec = params.structured_outputs
        compiling: Future[Any] | None = None
        if spec is not None:
            compiling = self.grammar_backend.submit(spec)  # refuses before anything is queued
            if compiling.done() and compiling.exception() is not None:
                raise compiling.exception()  # type: ignore[misc]
        timeout = timeout if timeout is not None else self.config.request_timeout
        deadline = time.monotonic() + timeout if timeout else None
        n = params.n
        seqs = [
            SchedSequence(
                seq_id=request_id if n == 1 else f"{request_id}-{i}",
                request_id=request_id,
                prompt_token_ids=ids,
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                seed=derive_choice_seed(params.seed, i),
                adapter_id=adapter_id,
                deadline=deadline,
                speculative=speculative,
                lookup_tenant=lookup_tenant,
                cache_namespace=cache_namespace,
                priority=priority,
                session_id=session_id,
                vision=vision,
            )
            for i in range(n)
        ]
        if compiling is not None and not compiling.done():
            for seq in seqs:
                seq.ready = False  # admitted once its grammar is compiled (`_poll_compiles`)
        added: list[SchedSequence] = []
        try:
            for seq in seqs:
                self.scheduler.add(seq)
                added.append(seq)
        except BaseException:
            for seq in added:
                self.scheduler.finish(seq, "abort")
            raise
        state = RequestState.create(request_id, text, ids, params, self.tokenizer, seqs)
        if spec is not None and compiling is not None:
            if compiling.done():
                self._attach_grammars(seqs, spec, compiling.result())
            else:
                self._compiling[request_id] = (compiling, spec)
        state.final_only = final_only
        self.requests[request_id] = state
        for choice in state.choices:
            self._choice_of[choice.seq.seq_id] = (state, choice)

    def check_prompt(
        self,
        prompt: str | Sequence[int] | None,
        prompt_token_ids: Sequence[int] | None,
        params: SamplingParams,
    ) -> tuple[str | None, list[int], int]:
        """Validate a request's prompt and sampling parameters without queueing anything:
        (prompt text or None, prompt token ids, the resolved output budget); see
        `check_request`, the one home of the context-length rule for requests."""
        return check_request(
            prompt, prompt_token_ids, params, self.tokenizer, self.vocab_size, self.max_model_len
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is (waiting, prefilling, decoding, swapped)."""
        state = self.requests.pop(request_id, None)
        self._compiling.pop(request_id, None)
        if state is None:
            return None
        for choice in state.choices:
            self.scheduler.finish(choice.seq, "abort")
            choice.close("abort", None)
            self._choice_of.pop(choice.seq.seq_id, None)
            self._grammar_of.pop(choice.seq.seq_id, None)
            self.speculation.forget(choice.seq)
        return state.to_output()
