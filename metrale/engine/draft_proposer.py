"""`DraftModelProposer`: speculative drafts from a smaller checkpoint with the target's
vocabulary (`speculative_config={"method": "draft_model", "model": DIR, ...}`).

Owner: engine (built by `speculation.build_proposer`; the draft is loaded by
`model_engine.draft_factory.load_draft_model`).

The draft is its own `TransformerModel` (same device and dtype as the target, no prefix cache,
eager forwards: no CUDA graphs yet) with its own `PagedKVCache`. Per sequence (`seq_id`) it
keeps a draft `SequenceState`. Each `propose`:
1. rolls every row's draft state back to the longest common prefix of what it holds and the
   row's committed tokens (after a verify with rejections it holds drafts that were not
   committed; after a preemption or a `seq_id` reuse anything may differ), keeping at least
   one token to feed so the row has fresh last logits;
2. feeds every row's missing committed tokens as prefill slices in one batched forward
   (chunked by `max_chunk_tokens` only when a catch-up is long, e.g. a new prompt) and takes
   the argmax of each row's last logits as draft 1;
3. runs `max_drafts - 1` batched decode steps (rows drop out as their budget is reached) for
   drafts 2..k, greedy. The drafts are one-hot, so the target's verification stays lossless
   under sampling.

Pools, one admission rule: the scheduler admits by the target's pool only. The draft pool
holds as many tokens as the target's (as many blocks of the same block size; the factory's KV
budget pays for both), so it only runs short where the target shares prefix-cache blocks and
the draft, which has no prefix cache, does not; or where draft states of sequences that are
not decoding now (preempted, gated off, waiting) still hold blocks. When a step's rows do not
fit, the draft state of every sequence outside the step is freed first; rows that still do
not fit get no drafts this step (`draft_pool_misses` counts them) and decode plainly. A draft
pool shortage therefore never blocks, preempts or slows admission of the target: it only
costs speculation. (Admitting by both pools would make a draft, an optimisation, able to
refuse work; sizing the draft pool for the target's prefix sharing would need a draft prefix
cache.)

Invariants:
- A draft is never more than `max_drafts` tokens, each an argmax over the draft's vocabulary,
  which is the target's (checked at load: `CheckpointError` otherwise).
- The target is never touched: the draft has its own blocks and sequence states, and a draft
  failure that is a pool shortage (`KVCacheExhausted`) drops that step's drafts only.
- After `on_finished(seq_id)` no draft block or state is held for that sequence; when every
  sequence has finished the draft pool is entirely free.
- Draft states only ever hold committed tokens followed by drafts of this proposer; the
  common-prefix rollback makes them correct again whatever the committed tokens became.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metrale.errors import InvalidRequestError, KVCacheExhausted
from metrale.model_engine.traits import Model, PrefillSlice, SequenceState
from metrale.model_engine.transformer_model import TransformerModel
from metrale.spec.config import SpeculativeConfig
from metrale.spec.proposer import DraftRequest, Proposer

logger = logging.getLogger(__name__)

#: Most catch-up tokens one draft forward takes (a long new prompt is fed in chunks).
MAX_CHUNK_TOKENS = 4096


@dataclass
class _DraftSeq:
    state: SequenceState
    #: Leading tokens of `state.tokens` known to equal the sequence's committed tokens.
    synced: int = 0


@dataclass
class _Row:
    index: int
    request: DraftRequest
    draft: _DraftSeq
    #: Drafts this row asks for (<= the request's max_drafts, capped by the draft's context).
    want: int
    #: Tokens of `request.tokens` the draft has not computed yet (after the rollback).
    missing: int = 0


class DraftModelProposer(Proposer):
    """Greedy drafts from a draft `TransformerModel` (see the module docstring)."""

    name = "draft_model"

    def __init__(
        self, draft: TransformerModel, k: int, max_chunk_tokens: int = MAX_CHUNK_TOKENS
    ) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if draft.has_ssm_layers():
            raise InvalidRequestError("a draft model with recurrent (SSM) layers is not supported")
        self.draft = draft
        self.k = k
        self.max_chunk_tokens = max(1, max_chunk_tokens)
        self._seqs: dict[str, _DraftSeq] = {}
        self._counters = {
            "draft_pool_misses": 0,
            "draft_evictions": 0,
            "draft_forwards": 0,
            "catchup_tokens": 0,
            "rollback_tokens": 0,
            "draft_errors": 0,
        }

    @classmethod
    def load(cls, config: SpeculativeConfig, model: Model) -> DraftModelProposer:
        """Load `config.model` beside the target `model` (a `TransformerModel`)."""
        from metrale.model_engine.draft_factory import load_draft_model

        if not isinstance(model, TransformerModel):
            raise InvalidRequestError(
                "speculative_config method 'draft_model' needs a TransformerModel target "
                f"(got {type(model).__name__})",
                param="speculative_config.method",
            )
        assert config.model is not None  # the config requires it for this method
        draft = load_draft_model(config.model, model)
        return cls(draft, config.num_speculative_tokens)

    # ------------------------------------------------------------------ propose

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        rows = self._prepare(requests)
        rows = self._fit(rows, {r.seq_id for r in requests})
        if not rows:
            return out
        try:
            self._run(rows, out)
        except KVCacheExhausted as exc:  # should not happen after `_fit`: drop the step's drafts
            self._counters["draft_errors"] += 1
            logger.warning("draft model: %s; no drafts this step", exc)
            return [[] for _ in requests]
        return out

    def _prepare(self, requests: Sequence[DraftRequest]) -> list[_Row]:
        """Roll each row's draft state back to its common prefix with the committed tokens."""
        rows: list[_Row] = []
        limit = self.draft.max_model_len
        for i, req in enumerate(requests):
            n = len(req.tokens)
            # Draft j (1-based) is computed from n + j - 1 tokens: the last fits the context.
            want = min(req.max_drafts, self.k, limit - n + 1)
            if n < 1 or want < 1:
                continue
            ds = self._seqs.get(req.seq_id)
            if ds is None:
                ds = self._seqs[req.seq_id] = _DraftSeq(self.draft.alloc_sequence())
            keep = min(self._common_prefix(ds, req.tokens), n - 1)
            if any(int(req.tokens[j]) < 0 for j in range(keep, n)):
                continue  # an unread fed token (FED_TOKEN): nothing to align drafts to
            self._truncate(ds, keep)
            rows.append(_Row(i, req, ds, want, n - keep))
        return rows

    def _common_prefix(self, ds: _DraftSeq, tokens: Sequence[int]) -> int:
        held = ds.state.tokens
        n = min(len(held), len(tokens))
        i = min(ds.synced, n)
        if ds.synced > len(tokens) or (i and held[i - 1] != tokens[i - 1]):
            i = 0  # not the sequence the draft followed (reused id): compare from the start
        while i < n and held[i] == tokens[i]:
            i += 1
        return i

    def _truncate(self, ds: _DraftSeq, length: int) -> None:
        state = ds.state
        drop = state.seq_len - length
        if drop > 0:
            self._counters["rollback_tokens"] += drop
            self.draft.commit_accepted_prefix(state, 0, drop)
        ds.synced = min(ds.synced, length)

    def _fit(self, rows: list[_Row], batch: set[str]) -> list[_Row]:
        """The rows whose blocks fit the draft pool (see the module docstring)."""
        need = {r.index: self._blocks(r) for r in rows}
        pool = self.draft.block_pool
        if sum(need.values()) <= pool.num_free:
            return rows
        for seq_id in [s for s in self._seqs if s not in batch]:
            self._counters["draft_evictions"] += 1
            self.draft.free_sequence(self._seqs.pop(seq_id).state)
        free = pool.num_free
        kept: list[_Row] = []
        for r in sorted(rows, key=lambda r: need[r.index]):  # the cheapest rows first
            if need[r.index] <= free:
                free -= need[r.index]
                kept.append(r)
            else:
                self._counters["draft_pool_misses"] += 1
        kept.sort(key=lambda r: r.index)
        return kept

    def _blocks(self, row: _Row) -> int:
        # The catch-up, then drafts 1..want-1 fed back (the last draft is never fed).
        return self.draft.blocks_needed(row.draft.state, row.missing + row.want - 1)

    @torch.inference_mode()
    def _run(self, rows: list[_Row], out: list[list[int]]) -> None:
        draft = self.draft
        # Catch-up: every row's missing committed tokens, in as few forwards as the chunk
        # budget allows (one, unless a long prompt is new); each row's last logits -> draft 1.
        pending = list(rows)
        while pending:
            budget = self.max_chunk_tokens
            slices: list[PrefillSlice] = []
            chunked: list[_Row] = []
            for r in pending:
                if budget <= 0:
                    break
                start = r.draft.state.seq_len
                todo = len(r.request.tokens) - start
                n = min(todo, budget)
                budget -= n
                slices.append(PrefillSlice(r.request.tokens, r.draft.state, start, n, n == todo))
                chunked.append(r)
            result = draft.mixed_forward_batch([], [], slices)
            self._counters["draft_forwards"] += 1
            self._counters["catchup_tokens"] += sum(s.chunk_len for s in slices)
            done = [(r, lg) for r, lg in zip(chunked, result.prefill_logits) if lg is not None]
            if done:
                firsts = torch.cat([lg for _, lg in done]).argmax(dim=-1).tolist()
                for (r, _), t in zip(done, firsts):
                    r.draft.synced = len(r.request.tokens)
                    out[r.index].append(int(t))
            finished = {id(r) for r, _ in done}
            pending = [r for r in pending if id(r) not in finished]
        # Drafts 2..k: batched greedy decode of the rows that want more.
        step = 1
        while True:
            active = [r for r in rows if r.want > step]
            if not active:
                break
            logits = draft.decode_batch(
                [out[r.index][-1] for r in active], [r.draft.state for r in active]
            )
            self._counters["draft_forwards"] += 1
            for r, t in zip(active, logits.argmax(dim=-1).tolist()):
                out[r.index].append(int(t))
            step += 1

    # ------------------------------------------------------------------ lifecycle

    def on_finished(self, seq_id: str, tokens: Sequence[int], tenant: str | None) -> None:
        ds = self._seqs.pop(seq_id, None)
        if ds is not None:
            self.draft.free_sequence(ds.state)

    def stats(self) -> dict[str, int]:
        return {
            "sequences": len(self._seqs),
            "draft_free_blocks": self.draft.num_free_blocks(),
            "draft_total_blocks": self.draft.num_total_blocks(),
            **self._counters,
        }

    def held_blocks(self) -> int:
        """Draft blocks held by sequence states (0 once every sequence has finished)."""
        return self.draft.num_total_blocks() - self.draft.num_free_blocks()
