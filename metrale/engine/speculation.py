"""`Speculation`: the engine's speculative-decoding state: the proposer, the throughput gate
and the counters, and the three moments the engine calls them (before a plan, after a read
back, when a stream ends).

Owner: engine (one per `Engine`; built from `EngineConfig.speculative_config`).

Invariants:
- Off (`proposer is None`) when not configured, or when the model cannot verify drafts
  (`can_batch_verify` is false; hybrid SSM models can, they roll their recurrent state back):
  then `disabled` says why, logged once at start-up, and every method is a no-op.
- `propose` only ever sets `spec_token_ids` of running decode rows that may speculate (the
  request did not opt out, the gate allows the batch width and the row, the proposer is not
  backing off), at most `min(k, Scheduler.draft_room)` tokens, each inside the vocabulary
  (a proposer that breaks that raises, failing the step, not the engine).
- `record` feeds each read-back step once: its cost to the gate (plain decode and verify
  steps; prefill steps are not decode costs), its verdicts to the proposer, the gate and
  `stats`.
- `forget` hands a finished stream's tokens to the proposer's shared index of its tenant and
  drops its per-sequence proposer and gate state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from metrale.errors import InvalidRequestError
from metrale.model_engine.traits import Model
from metrale.scheduler.core import Committed, Scheduler
from metrale.scheduler.plan import StepPlan
from metrale.scheduler.sequence import SchedSequence, Status
from metrale.spec.config import SpeculativeConfig
from metrale.spec.gate import SpecGate
from metrale.spec.proposer import DraftRequest, Proposer
from metrale.spec.stats import SpecStats

logger = logging.getLogger(__name__)


def build_proposer(config: SpeculativeConfig, model: Model) -> Proposer:
    """The proposer of `config.method`: host lookups from `spec`, model-backed ones (MTP
    head, draft checkpoint) from their engine modules."""
    if config.method == "mtp":
        from metrale.engine.mtp_proposer import MtpProposer

        return MtpProposer(model, config.num_speculative_tokens)
    if config.method == "draft_model":
        from metrale.engine.draft_proposer import DraftModelProposer

        return DraftModelProposer.load(config, model)
    return config.make_proposer()


class Speculation:
    def __init__(
        self,
        config: SpeculativeConfig | None,
        model: Model,
        vocab_size: int,
        proposer: Proposer | None = None,
    ) -> None:
        self.stats = SpecStats()
        self.proposer: Proposer | None = None
        self.gate: SpecGate | None = None
        self.k = 0
        self.vocab_size = vocab_size
        #: Why speculation is off although configured (None: on, or not configured).
        self.disabled: str | None = None
        if config is None:
            if proposer is not None:
                raise InvalidRequestError(
                    "a proposer needs speculative_config (its num_speculative_tokens)",
                    param="speculative_config",
                )
            return
        k = config.num_speculative_tokens
        if not model.can_batch_verify([k + 1]):
            self.disabled = "the model cannot verify drafts (can_batch_verify is false)"
            logger.warning("speculative decoding is off: %s", self.disabled)
            return
        self.proposer = proposer or build_proposer(config, model)
        self.k = k
        self.gate = SpecGate(
            k,
            enabled=config.gate == "auto",
            window=config.gate_window,
            probe_tokens=config.gate_probe_tokens,
        )
        logger.info(
            "speculative decoding: %s (proposer %s)",
            config.describe(), self.proposer.name or type(self.proposer).__name__,
        )  # fmt: skip

    def may_speculate(self, seq: SchedSequence) -> bool:
        gate, proposer = self.gate, self.proposer
        return (
            proposer is not None
            and gate is not None
            and seq.speculative
            and gate.row_allowed(seq.seq_id, len(seq.output_token_ids))
            and proposer.may_propose(seq.seq_id)
        )

    def wants_verify(self, seqs: Sequence[SchedSequence]) -> bool:
        """Whether a step of these decode rows could speculate (then it is not fed)."""
        if self.proposer is None or self.gate is None or not seqs:
            return False
        if not self.gate.step_allowed(len(seqs)):
            return False
        return any(s.status is Status.RUNNING and self.may_speculate(s) for s in seqs)

    def propose(self, scheduler: Scheduler) -> None:
        """Drafts for the decoding sequences that may speculate; the scheduler caps them and
        gives them to the next plan (`spec_token_ids`)."""
        proposer, gate = self.proposer, self.gate
        if proposer is None or gate is None:
            return
        decoding = [s for s in scheduler.running if s.is_decoding()]
        if not decoding or not gate.step_allowed(len(decoding)):
            return
        requests: list[DraftRequest] = []
        asking: list[SchedSequence] = []
        for seq in decoding:
            room = min(self.k, scheduler.draft_room(seq))
            if room <= 0 or not self.may_speculate(seq):
                if seq.lookup_tenant is not None:
                    proposer.observe(seq.seq_id, seq.token_view(), seq.lookup_tenant)
                continue
            asking.append(seq)
            request = DraftRequest(
                seq.seq_id, seq.token_view(), seq.prompt_len, room, seq.lookup_tenant, seq.state
            )
            requests.append(request)
        if not requests:
            return
        drafts = proposer.propose(requests)
        for seq, request, draft in zip(asking, requests, drafts, strict=True):
            tokens = [int(t) for t in draft[: request.max_drafts]]
            if any(not 0 <= t < self.vocab_size for t in tokens):
                raise ValueError(
                    f"proposer {proposer.name!r} proposed a token outside the vocabulary"
                )
            seq.spec_token_ids = tokens

    def record(self, plan: StepPlan, committed: list[Committed], seconds: float) -> None:
        """A read-back step: `seconds` of wall time (planning to tokens read) and its
        committed tokens."""
        gate, proposer = self.gate, self.proposer
        if gate is None or proposer is None:
            return
        if plan.decode and not plan.prefill:
            gate.record_step(
                len(plan.decode), plan.num_tokens, seconds, len(committed), plan.is_verify
            )
        if not plan.is_verify:
            return
        self.stats.verify_steps += 1
        for c in committed:
            if c.drafted:
                self.stats.record(c.drafted, c.accepted)
                proposer.on_verified(c.seq.seq_id, c.drafted, c.accepted)
                gate.record_verify(c.seq.seq_id, c.drafted, c.accepted, len(c.seq.output_token_ids))

    def forget(self, seq: SchedSequence) -> None:
        """A finished stream (see the invariants)."""
        if self.proposer is None or self.gate is None:
            return
        self.proposer.on_finished(seq.seq_id, seq.all_tokens, seq.lookup_tenant)
        self.gate.forget(seq.seq_id)
