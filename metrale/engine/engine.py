"""`Engine`: one step at a time over the scheduler, the model and the sampler.

Owner: engine. `add_request` validates and queues; `step` plans one forward, launches it and
its sampler, builds the previous step's outputs while the device computes, then commits this
step's tokens to the scheduler; `abort_request` ends a request wherever it is. The device
side of a step (forward, sampler, commit) is `engine_forward.py`'s; turning committed tokens
into outputs, and what a failed step or a finished request releases, `engine_outputs.py`'s.

Invariants:
- Validation happens entirely before any state changes: a bad request raises a clear error
  and leaves the engine exactly as it was, serving the others.
- A request's choices are separate scheduler sequences (`<id>` for n=1, `<id>-<i>` else); the
  request finishes when all its choices have.
- An exception inside a forward ends the requests of that step with finish reason "error"
  (their resources released); the engine keeps serving, except after `EngineDeadError` (a
  tensor-parallel rank died), which leaves `step` and ends the engine.
- `sampling_defaults` (the checkpoint's generation_config.json values, empty under
  `--generation-config none`) is read once at start-up; a request queued without
  `SamplingParams` gets `default_sampling_params()`. Explicit `SamplingParams` are used as given.
- Host work overlaps the device: a step's tokens are committed to the scheduler as soon as they
  are read back (so EOS, stop tokens and lengths end sequences before the next plan, and
  seeded draws and penalties see every token), but their text, stop strings and outputs are
  built during the next step's forward. A sequence a stop string ends has then already been
  planned once more: that token is dropped, never shown. Outputs therefore trail the device
  by one step; when nothing more is planned they are emitted at once.
- Async scheduling (`EngineConfig.async_scheduling`, on by default where the model has a
  device token feed): a launched step stays in flight when `step` returns; the next call
  launches the following plain decode step (`Scheduler.plan_fed_step`) with its input tokens
  read on the device, and only then reads the previous step back, so the host's planning,
  input staging, graph launch and output building hide behind the forward. Seeded draws and
  min_tokens count the in-flight token; penalties read it on the device. A step that needs
  anything else (an admission, a prefill chunk, a preemption, a timeout) first reads the
  in-flight step back ("drained"). Tokens, logprobs and finish reasons are those of the
  synchronous schedule; a row planned for a sequence its previous token ended is computed
  and dropped. At most one step is ever in flight, so `schedule()` always sees every token
  committed.
- Speculative decoding (`self.speculation`, see `engine/speculation.py`): drafts are
  proposed only before a step planned from the known tokens; a step that could speculate
  drains the pipeline instead of being fed (counted in `spec_stats.drained_for_spec`).
- LoRA (the registry surface in `engine_lora.py`): a request's `adapter_id` must name an
  adapter the engine has loaded (0: the base
  model), else the request is refused; its draft-lookup tenant is the request's with the
  adapter appended, so adapters never share lookup state. An adapter is unloaded only while
  no unfinished request uses it (`unload_lora_adapter` refuses otherwise).
- Structured output (`SamplingParams.structured_outputs`; compiles, matchers and draft cuts
  in `engine_grammar.py`): `add_request` parses the grammar
  (a spec xgrammar refuses is an `InvalidRequestError`, nothing queued) and its compile runs
  on the grammar backend's worker thread (cached by spec,
  `metrale.sampling.grammar.GrammarBackend`); the request's sequences wait, not `ready`,
  until `step` finds it done (a compile that fails ends the request "error"). Each choice owns a
  `GrammarState` synced to its sequence's output tokens at commit and before each sample, so
  preemption and prefix caching never advance it twice. A decode step after one that
  sampled a grammar row is still fed on the device, but its sampler is queued only after
  that step is read back and the matchers advanced, so the host fills the mask while the
  forward runs (`late_sampled_steps`; the matchers advance and the rows fill on the grammar
  worker threads while the main thread waits with the GIL released,
  `grammar_rows_prefilled`, the grammars that terminated end their sequences once that is
  done, then the sampler is queued, and only then are earlier steps' outputs built); a
  step that cannot be fed reads back first (`host_token_drains`), as a bad word of several
  tokens always does.
  A constrained row's drafts are cut before the first token its grammar refuses
  (`grammar_drafts_cut`) and verified under the grammar's mask at every position, so
  speculation stays lossless. A choice whose grammar terminates finishes ("stop").
- The engine is not thread-safe: `AsyncEngine` owns one from a single thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from metrale.config import EngineConfig
from metrale.distributed.launch import load_tensor_parallel
from metrale.engine.cpu_threads import CpuThreadGovernor
from metrale.engine.engine_forward import EngineForward, _Forward
from metrale.engine.engine_grammar import EngineGrammar
from metrale.engine.engine_intake import EngineIntake
from metrale.engine.engine_lora import EngineLora
from metrale.engine.engine_outputs import EngineOutputs, _Pending
from metrale.engine.intake import (  # noqa: F401  (BUNDLED_MODEL_DIR, resolve_model_dir: re-exported)
    BUNDLED_MODEL_DIR,
    BUNDLED_MODEL_NAME,
    DEFAULT_TENANT,
    bad_word_ids,
    check_request,
    resolve_model_dir,
)
from metrale.engine.output import ChoiceState, RequestState
from metrale.engine.request import RequestOutput
from metrale.engine.speculation import Speculation
from metrale.engine.vision import vision_prompts_for
from metrale.errors import EngineDeadError
from metrale.model_engine.factory import LoadReport, load_model
from metrale.model_engine.traits import Model
from metrale.progress import LoadProgress, load_progress
from metrale.sampling.defaults import SamplingDefaults, describe, load_sampling_defaults
from metrale.sampling.grammar import GrammarBackend, GrammarState
from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import SampledBatch, Sampler
from metrale.sampling.structured import GrammarSpec
from metrale.sampling.warm import warm_sampler
from metrale.scheduler.core import Scheduler, SchedulerConfig
from metrale.scheduler.plan import StepPlan
from metrale.spec.proposer import Proposer
from metrale.spec.stats import SpecStats
from metrale.tokenizer.tokenizer import Tokenizer

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose tokens have not been read back (its copy to the host queued)."""

    plan: StepPlan
    batch: SampledBatch
    #: `time.perf_counter()` when the step's planning began (the gate's step cost).
    started: float = 0.0


class Engine(EngineIntake, EngineLora, EngineGrammar, EngineForward, EngineOutputs):
    def __init__(
        self,
        config: EngineConfig,
        *,
        model: Model | None = None,
        tokenizer: Tokenizer | None = None,
        max_prefill_chunk: int | None = None,
        proposer: Proposer | None = None,
        progress: LoadProgress | None = None,
        cpu_threads: CpuThreadGovernor | None = None,
    ) -> None:
        """`progress` hears how the load goes (default: `load_progress()`, a bar on a
        terminal, log lines otherwise). `cpu_threads`: the served CPU engine's torch threads
        per forward (`apply_engine_threads`); None leaves them as they are."""
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        # Read before the weights, so that a bad generation_config.json fails fast.
        self.sampling_defaults = (
            load_sampling_defaults(self.model_dir)
            if config.uses_generation_config
            else SamplingDefaults()
        )
        if self.sampling_defaults:
            logger.info(
                "Default sampling parameters have been overridden by the model's generation "
                "config (%s); requests that set them still win. Pass --generation-config none "
                "to use metrale's defaults.",
                describe(self.sampling_defaults),
            )
        self.load_report: LoadReport | None = None
        if model is None:
            # Tensor parallel: rank 0 here, the other ranks' processes started by the loader.
            loader = load_tensor_parallel if config.tensor_parallel_size > 1 else load_model
            model, self.load_report = loader(
                config, self.model_dir, progress if progress is not None else load_progress()
            )
        self.model = model
        self.tokenizer = tokenizer or Tokenizer.from_dir(
            config.tokenizer or self.model_dir, chat_template=config.chat_template
        )
        #: Images -> prompt tokens and `VisionInputs`; None for a text-only model.
        self.vision = vision_prompts_for(config, self.model_dir, model)
        limit = model.max_context_len()
        #: The context limit every request is checked against (`check_prompt`).
        self.max_model_len = int(limit if limit is not None else config.max_model_len or 0)
        device_type = (model.device_name() or "cpu").split(":")[0]
        batched = config.resolved_batched_tokens(device_type)
        if config.max_num_batched_tokens is None and batched > config.default_batched_tokens(
            device_type
        ):
            logger.info(
                "max_num_batched_tokens (derived) raised to max_num_seqs (%d) so every running "
                "sequence can decode each step",
                batched,
            )
        self.scheduler = Scheduler(
            model,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=self.max_model_len,
                max_prefill_chunk=max_prefill_chunk,
                preemption_mode=config.preemption_mode,
                scheduling_policy=config.scheduling_policy,
                swap_space_bytes=int(config.swap_space_gb * 2**30),
                swap_spill_dir=config.swap_spill_dir,
                swap_spill_bytes=int(config.swap_spill_gb * 2**30),
                enable_prefix_caching=config.enable_prefix_caching,
                max_queue=config.max_queue,
            ),
        )
        self.sampler = Sampler(seed=config.seed, ops=model.sampling_ops())
        #: Torch threads per forward on the CPU when served (`cpu_threads.CpuThreadGovernor`).
        self.cpu_threads = cpu_threads
        if cpu_threads is not None:
            cpu_threads.set_model(model)
        warm_sampler(self.sampler, model.vocab_size(), model.device_name() or "cpu")
        self.requests: dict[str, RequestState] = {}
        self._choice_of: dict[str, tuple[RequestState, ChoiceState]] = {}
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | model.eos_token_ids()
        self.vocab_size = model.vocab_size()
        self.num_steps = 0
        #: Steps launched on the device token feed, and fed-eligible steps that had to be read
        #: back before the next plan (an admission, a prefill, a preemption...): metrics.
        self.fed_steps = 0
        self.drained_steps = 0
        #: Fed steps of grammar rows whose sampler waited for the step before to be read
        #: back (the mask needs its token on the host); their forwards were not delayed.
        self.late_sampled_steps = 0
        #: Mask rows of late-sampled steps filled on the grammar worker thread while the
        #: step's outputs were built.
        self.grammar_rows_prefilled = 0
        self.async_scheduling = config.async_scheduling and model.supports_device_token_feed()
        if config.async_scheduling and not self.async_scheduling:
            logger.warning(
                "async scheduling is off: the model has no device token feed; every step is "
                "planned after the previous one is read back"
            )
        self._pending: list[_Pending] = []
        self._inflight: _InFlight | None = None
        self.speculation = Speculation(config.speculative(), model, self.vocab_size, proposer)
        #: When the last step was read back (the gate's step intervals).
        self._last_read = 0.0
        #: Structured output: the compiler (built on the first constrained request) and each
        #: constrained sequence's matcher, by seq_id.
        self._grammars: GrammarBackend | None = None
        self._grammar_of: dict[str, GrammarState] = {}
        #: Requests whose grammar is compiling (their sequences wait, not ready), by id.
        self._compiling: dict[str, tuple[Future[Any], GrammarSpec]] = {}
        #: Drafts cut because the grammar refuses them; steps read back because the step
        #: before sampled a grammar row (metrics and tests).
        self.grammar_drafts_cut = 0
        #: Steps read back (not fed) because a row's mask needs its sampled token on the
        #: host, by cause ("structured output", "bad words").
        self.host_token_drains: dict[str, int] = {}

    # Speculation's counters (its proposer, gate and k: `self.speculation`).
    @property
    def spec_stats(self) -> SpecStats:
        return self.speculation.stats

    @property
    def served_model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        if self.config.model is None:
            return BUNDLED_MODEL_NAME
        if self.model_dir != self.config.model:  # a repo id found in the Hugging Face cache
            return self.config.model
        return Path(self.model_dir).name

    def default_sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with the model's generation-config defaults applied."""
        return self.sampling_defaults.sampling_params()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    # -------------------------------------------------------------------- step

    def step(
        self, on_outputs: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that changed (see
        `step_as`)."""
        return self.step_as(RequestState.to_output, on_outputs)  # type: ignore[arg-type]

    def step_as(
        self,
        build: Callable[[RequestState], T],
        on_outputs: Callable[[list[T]], None] | None = None,
    ) -> list[T]:
        """Run one engine step; returns `build(state)` for every request that changed (`step`:
        its `RequestOutput`; the engine process builds its wire deltas from the state, with no
        cumulative output in between).

        A step launches one forward and its sampler, then, while the device computes, turns
        earlier steps' committed tokens into outputs (detokenize, stop strings), then reads
        back and commits the step before it. Under async scheduling, a plain decode step is
        launched before the previous step is read back (its input tokens fed on the device)
        and stays in flight until the next call; any other step drains the pipeline first.

        With `on_outputs`, the outputs built while the device computes are handed to it at
        once (before the wait), and only the rest are returned: a server can ship them while
        the forward runs."""
        touched: dict[str, RequestState] = {}
        started = time.perf_counter()
        late_sample = False
        if self._compiling:
            self._poll_compiles(touched)
        ready, self._pending = self._pending, []
        previous, self._inflight = self._inflight, None
        plan: StepPlan | None = None
        if previous is not None:
            needs = self._host_token_need(previous.plan.sampled)
            if self.speculation.wants_verify(previous.plan.sampled):
                self.spec_stats.drained_for_spec += 1  # drafts need every token known
            elif needs == "structured output" and (
                fed := self.scheduler.plan_fed_step(previous.plan)
            ):
                # The forward is fed on the device; only the sampler waits for the mask,
                # filled once `previous` is read back, while this forward runs.
                plan, late_sample = fed, True
            elif needs is not None:
                # The next step's mask needs the sampled token on the host.
                if needs not in self.host_token_drains:
                    logger.info(
                        "%s: a step after such a row is read back before the next is planned "
                        "(the mask needs the sampled token on the host); counted in "
                        "drained_steps", needs,
                    )  # fmt: skip
                self.host_token_drains[needs] = self.host_token_drains.get(needs, 0) + 1
            else:
                plan = self.scheduler.plan_fed_step(previous.plan)
            if plan is None:  # read the step back before planning from the known tokens
                self.drained_steps += 1
                self._read_back(previous, ready, touched)
                previous = None
        if plan is None:
            self.speculation.propose(self.scheduler)
            if self._grammar_of:
                self._cut_drafts()
            plan = self.scheduler.schedule()
            if plan.is_empty() and self._compiling:  # only compiles to wait for: not a spin
                futures.wait([f for f, _ in self._compiling.values()], timeout=0.005)
            for seq in plan.finished:
                self._close_choice(seq, touched)
        launched: SampledBatch | None = None
        forward: _Forward | None = None
        if not plan.is_empty():
            self.num_steps += 1
            self.fed_steps += plan.feed_rows is not None
            self.late_sampled_steps += late_sample
            if self.cpu_threads is not None:
                self.cpu_threads.before_forward(plan.num_tokens)
            try:
                forward = self._forward_step(plan, previous)
                if not late_sample:
                    launched = self._sample_step(plan, forward)
            except EngineDeadError:  # a tensor-parallel rank died: nothing can be served
                raise
            except Exception as exc:  # one bad step must not take the engine down
                self._step_failed(plan, touched, exc)
                forward = None
        grammar_work: futures.Future[None] | None = None
        late_read: tuple[StepPlan, _Pending] | None = None
        if late_sample and previous is not None:
            # `previous` committed first; its matchers advance, then the mask rows of this
            # step fill, on the grammar worker threads while this thread waits for them.
            read = self._read_back(previous, self._pending, touched, advance_grammars=False)
            states = [g for s in plan.sampled if (g := self._grammar_of.get(s.seq_id))]
            prefill = states if forward is not None else []
            if read is not None:
                late_read = (previous.plan, read)
            committed = read.committed if read is not None else []
            grammar_work = self._advance_grammars_async(committed, prefill)
            self.grammar_rows_prefilled += len(prefill)
            previous = None
        if late_read is not None:  # its matchers advanced: end the terminated grammars
            read_plan, read = late_read
            try:
                if grammar_work is not None:
                    grammar_work.result()
                    grammar_work = None
                read.committed[:] = self._finish_terminated(read.committed)
            except Exception as exc:
                self._step_failed(read_plan, touched, exc)
        if late_sample and forward is not None:
            try:  # `previous` is committed: its tokens are in the outputs and the matchers
                if grammar_work is not None:
                    grammar_work.result()
                launched = self._sample_step(plan, _Forward(forward.logits, 0, None))
            except Exception as exc:
                self._step_failed(plan, touched, exc)
        # Earlier steps' outputs are built while the device computes: after a late-sampled
        # step's sampler is queued (the main thread waits for the grammar workers with the GIL
        # released, so their accepts and fills are not held back by this Python work), and
        # before a drained step's read-back.
        for pending in ready:
            self._emit(pending, touched)
        if on_outputs is not None and touched:
            on_outputs(self._outputs(touched, build))
            touched = {}
        if previous is not None:
            self._read_back(previous, self._pending, touched)
        if launched is not None:
            step = _InFlight(plan, launched, started)
            if self.async_scheduling:  # the next call may launch a fed step before reading it
                self._inflight = step
            else:
                self._read_back(step, self._pending, touched)
        if self._pending and self._inflight is None and not self.scheduler.has_unfinished():
            # Nothing will be launched next: emit now rather than after an idle step.
            ready, self._pending = self._pending, []
            for pending in ready:
                self._emit(pending, touched)
        return self._outputs(touched, build)

    def _read_back(
        self,
        step: _InFlight,
        into: list[_Pending],
        touched: dict[str, RequestState],
        advance_grammars: bool = True,
    ) -> _Pending | None:
        """Wait for a launched step's tokens and commit them (a failure ends its requests);
        the committed step, or None if it failed."""
        pending = None
        try:
            pending = self._commit(step.plan, step.batch, advance_grammars)
            into.append(pending)
            seconds = time.perf_counter() - max(self._last_read, step.started)
            self.speculation.record(step.plan, pending.committed, seconds)
        except Exception as exc:
            self._step_failed(step.plan, touched, exc)
            pending = None
        self._last_read = time.perf_counter()
        return pending
