"""`VerifyForwards`: the speculative verify passes of `TransformerModel`: a decode row with
drafts computes its last token and every draft in one forward, and the commit keeps the
accepted prefix.

Owner: model-engine. A mixin of `TransformerModel`, which provides the forward machinery it
drives (`_mixed`, `_allocate_blocks`, `_advance`) and the attributes declared below.

Invariants:
- A verify row advances by its last token plus its drafts and returns logits for each;
  `commit_accepted_prefix` then drops the rejected drafts from `seq_len`, `tokens` and
  `kv_valid_tokens` and returns the blocks past the kept tokens, which only that verify had
  allocated. On hybrid models the recurrent layers run verify rows token by token and the
  commit rolls their state back to the accepted prefix (`ssm_verify.py`: checkpoint,
  replay); `checkpoint_ssm_states` / `rollback_ssm_states` are that module's stash.
- A graphed verify pads rows to the captured query length by repeating their last token; the
  padding's KV lands past the row's new `seq_len` and its blocks go back at once, so the
  sequence is exactly as after an eager verify. It never runs past `max_model_len`. Hybrid
  models have no graphs; their verify always runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from metrale.cache.block_pool import BlockPool
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.layers.recurrent_verify import RecurrentVerify
from metrale.model_engine.batch import ForwardRow
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from metrale.model_engine.ssm_verify import SsmVerifyStash
from metrale.model_engine.traits import (
    MixedBatchResult,
    PrefillSlice,
    SequenceState,
    Stream,
    VerifyBatchedOpts,
    blocks_for,
)


class VerifyForwards:
    """Speculative verify over `TransformerModel`'s forward (a mixin)."""

    block_pool: BlockPool
    block_size: int
    ssm_pool: SsmSlotPool | None
    #: Hybrid models: each verify row's checkpoint and inputs until its commit (else None).
    ssm_stash: SsmVerifyStash | None
    graph_runner: DecodeGraphRunner | None
    _last_hidden: torch.Tensor | None
    mtp_enabled: bool
    lora_eager_forwards: int

    if TYPE_CHECKING:  # provided by `TransformerModel` (and `_mixed`, its forward)

        def _allocate_blocks(self, rows: list[ForwardRow]) -> None: ...

        def _advance(self, rows: list[ForwardRow]) -> None: ...

        def fits_context(self, seq: SequenceState, new_tokens: int) -> bool: ...

        def blocks_needed(self, seq: SequenceState, new_tokens: int) -> int: ...

        def _keep_mtp_rows(
            self, rows: list[ForwardRow], hidden: torch.Tensor | None, owned: bool
        ) -> None: ...

        def _cut_mtp_rows(self, seq: SequenceState) -> None: ...

    def can_batch_verify(self, ks: Sequence[int]) -> bool:
        """Any mix of row counts verifies in one forward (hybrids too: their recurrent
        layers run verify rows token by token and the commit rolls them back)."""
        return True

    def mixed_verify_batch(
        self,
        decode_tokens: Sequence[int],
        drafts: Sequence[Sequence[int]],
        decode_seqs: Sequence[SequenceState],
        prefill_streams: Sequence[PrefillSlice],
        stream: Stream = None,
    ) -> MixedBatchResult:
        if not prefill_streams and decode_seqs and self.ssm_pool is None:
            graphed = self._verify_graphed(decode_tokens, drafts, decode_seqs)
            if graphed is not None:
                return MixedBatchResult(graphed, [])
        return self._mixed(decode_tokens, drafts, decode_seqs, prefill_streams)

    # ------------------------------------------------------------ recurrent state

    def _begin_recurrent_verify(
        self, rows: list[ForwardRow], num_single: int, num_decode_rows: int
    ) -> RecurrentVerify | None:
        """Before a forward: on hybrids, mark the decode-side rows from the first verify row
        on as sequential (see `ssm_verify.py`). None when nothing is sequential."""
        if self.ssm_stash is None:
            return None
        return self.ssm_stash.begin(rows, num_single, num_decode_rows)

    def _end_recurrent_verify(self, capture: RecurrentVerify | None) -> None:
        """After the forward and the advance: keep each verify row's capture until its commit."""
        if capture is not None and self.ssm_stash is not None:
            self.ssm_stash.adopt(capture)

    def checkpoint_ssm_states(self, seq: SequenceState) -> None:
        """A bare checkpoint of `seq`'s recurrent state (a verify forward takes its own)."""
        if self.ssm_stash is not None:
            self.ssm_stash.checkpoint(seq)

    def rollback_ssm_states(self, seq: SequenceState, num_accepted: int) -> None:
        """Restore the last verify's checkpoint and replay its last verified token and first
        `num_accepted` drafts (`SsmVerifyStash.rollback`); `seq_len` is the caller's."""
        if self.ssm_stash is not None:
            self.ssm_stash.rollback(seq, num_accepted)

    def _verify_graphed(
        self,
        decode_tokens: Sequence[int],
        drafts: Sequence[Sequence[int]],
        seqs: Sequence[SequenceState],
    ) -> torch.Tensor | None:
        """A verify-only step replayed from the (batch, Q) graph whose Q covers every row's
        drafts; rows with fewer drafts are padded by repeating their last token, and the
        padding's KV lands past the row's new `seq_len` (blocks taken for it go back at
        once). None when no captured graph fits, or the padding's blocks or context are not
        available: the caller runs the step eagerly."""
        runner = self.graph_runner
        if runner is None or len(decode_tokens) != len(seqs) or len(drafts) != len(seqs):
            return None
        adapters = np.fromiter((s.adapter_slot for s in seqs), np.int64, len(seqs))
        if runner.lora is None and (adapters >= 0).any():
            self.lora_eager_forwards += 1
            return None  # graphs without LoRA never run an adapter row
        longest = max(len(d) for d in drafts) + 1
        q = next((q for q in runner.query_lens if q >= longest), None)
        if q is None or q == 1 or not runner.can_run(len(seqs), q):
            return None
        if self._vision_verify_eager(seqs):  # type: ignore[attr-defined]
            return None
        if not all(self.fits_context(s, q) for s in seqs):
            return None
        padded = [
            ForwardRow(s, [int(t), *map(int, d), *[int(t)] * (q - 1 - len(d))], True)
            for t, d, s in zip(decode_tokens, drafts, seqs)
        ]
        need = sum(self.blocks_needed(r.seq, q) for r in padded)
        if need > self.block_pool.num_free:
            return None
        self._allocate_blocks(padded)
        tokens = np.asarray([r.tokens for r in padded], dtype=np.int64)
        starts = np.fromiter((s.seq_len for s in seqs), dtype=np.int64, count=len(seqs))
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        with torch.inference_mode():
            if runner.lora is not None:
                logits = runner.run_verify(tokens, starts, tables, adapter_slots=adapters)
            else:
                logits = runner.run_verify(tokens, starts, tables)
            index = None
            if all(len(d) + 1 == q for d in drafts):
                selected = logits  # no padding: every row is the graph's rows
            else:
                rows_kept = [b * q + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
                host = torch.tensor(rows_kept, dtype=torch.int64)
                if logits.device.type == "cuda":
                    host = host.pin_memory()
                index = host.to(logits.device, non_blocking=True)
                selected = logits.index_select(0, index)
        self._last_hidden = None
        rows = [
            ForwardRow(s, [int(t), *map(int, d)], True)
            for t, d, s in zip(decode_tokens, drafts, seqs)
        ]
        if self.mtp_enabled:  # the head reads the real rows, not the padding
            hidden = runner.head_hidden(len(seqs), q)
            if hidden is not None and index is not None:
                hidden = hidden.index_select(0, index)  # a new tensor: nothing overwrites it
            self._keep_mtp_rows(rows, hidden, owned=index is not None)
        self._advance(rows)
        for s in seqs:
            self._release_blocks_past_seq_len(s)  # the padding's
        return selected

    def decode_verify(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        """`[last_verified, draft0, ...]` through one forward; the argmax at each position.
        The sequence advances by `len(tokens)`; `commit_accepted_prefix` rewinds it."""
        return self.decode_verify_batched(tokens, [len(tokens)], [seq], stream)

    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceState],
        stream: Stream = None,
        opts: VerifyBatchedOpts | None = None,
    ) -> list[int]:
        """Sequence `i` feeds `ks[i]` rows (its last verified token and `ks[i] - 1` drafts),
        flat and sequence-major in `tokens`; returns the argmax id of every row."""
        if len(ks) != len(seqs) or sum(ks) != len(tokens) or any(k < 1 for k in ks):
            raise ValueError("decode_verify_batched: tokens, ks and seqs do not line up")
        firsts: list[int] = []
        drafts: list[list[int]] = []
        offset = 0
        for k in ks:
            firsts.append(int(tokens[offset]))
            drafts.append([int(t) for t in tokens[offset + 1 : offset + k]])
            offset += k
        result = self.mixed_verify_batch(firsts, drafts, seqs, [], stream)
        assert result.decode_logits is not None
        return [int(t) for t in result.decode_logits.argmax(dim=-1).tolist()]

    def commit_accepted_prefix(self, seq: SequenceState, num_accepted: int, k: int) -> None:
        """Keep the last verify's input token and its first `num_accepted` of `k` drafts:
        `seq_len`, `tokens` and `kv_valid_tokens` drop the rejected `k - num_accepted`, and
        blocks past the kept tokens go back to the pool (they were allocated by the verify,
        so nothing shares them). The slots left past `seq_len` are overwritten later. On
        hybrids the recurrent state is rolled back to the kept tokens first."""
        if not 0 <= num_accepted <= k:
            raise ValueError(f"num_accepted {num_accepted} is outside [0, {k}]")
        if k > seq.seq_len:
            raise ValueError(f"cannot roll back {k} drafts of a {seq.seq_len}-token sequence")
        drop = k - num_accepted
        if self.ssm_stash is not None:
            self.ssm_stash.commit(seq, num_accepted, k)
        if drop:
            seq.seq_len -= drop
            del seq.tokens[seq.seq_len :]
            seq.kv_valid_tokens = min(seq.kv_valid_tokens, seq.seq_len)
        self._release_blocks_past_seq_len(seq)
        if self.mtp_enabled:
            self._cut_mtp_rows(seq)
        if k:  # hybrid prefix caching: the committed state may sit on a block boundary
            self.decode_marconi_checkpoint(seq)

    def _release_blocks_past_seq_len(self, seq: SequenceState) -> None:
        """Return the blocks past the ones `seq_len` fills; only a verify (its rejected
        drafts or its padding) can have allocated them, so nothing else holds them."""
        keep = blocks_for(seq.seq_len, self.block_size)
        if len(seq.block_table) > keep:
            self.block_pool.decref(seq.block_table[keep:])
            del seq.block_table[keep:]
