"""`MtpDrafting`: the MTP draft proposer inside `TransformerModel`: the main model's hidden
rows are kept per sequence as forwards produce them, and a propose runs the checkpoint's MTP
head (`metrale/models/mtp.py`) over them, then recursively for further drafts.

Owner: model-engine. A mixin of `TransformerModel`, on when the factory builds the model with
`mtp=True` (speculative method "mtp"); `metrale/engine/mtp_proposer.py` is its only caller.

Invariants:
- The head's KV lives in the same paged pool under the same block tables: the KV cache holds
  the main model's layers, then one layer per head layer; the head's row at position p writes
  slot p of that layer. Its KV is valid for every position whose hidden row it has consumed.
- `seq.proposer_state` is an `MtpPending`: the hidden rows of positions
  `[start, seq_len)` that the head has not consumed yet (every forward appends its rows; a
  verify's rejected rows are cut by `commit_accepted_prefix`). Rows must stay contiguous
  and end at `seq_len`; a forward whose rows do not continue them (a prefix-cache hit, a
  graphed step without hidden rows) restarts them, and the head's KV before the restart
  is a hole: drafts get worse, never wrong (the verify decides). At most
  `MAX_PENDING_ROWS` rows are kept (the oldest are dropped the same way).
- A forward's prompt chunks feed the head at once every pending row whose next token they
  know (all but each chunk's last row: `_mtp_prefill_catch_up`), so the head sees a prompt
  in full and its pending rows stay few; decode and verify rows wait for the next propose.
- A propose consumes every pending row of its sequences (row p pairs hidden p with token
  p + 1, the newest committed token for the last row), then runs one head step per further
  draft at positions `seq_len .. seq_len + k - 2`. Blocks for those positions are taken
  from the pool now (the verify that follows uses them; a commit returns what it does not
  keep); a sequence whose blocks are not free gets fewer drafts.
- Drafts are the head's argmax (one-hot q), so verification stays lossless under sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from metrale.cache.block_pool import BlockPool
from metrale.cache.kv_cache import PagedKVCache
from metrale.errors import InvalidRequestError
from metrale.model_engine.batch import ForwardRow, build_forward_batch
from metrale.model_engine.mtp_graphs import MtpGraphRunner
from metrale.model_engine.traits import FED_TOKEN, SequenceState, Stream
from metrale.spec.config import MAX_SPECULATIVE_TOKENS

#: Most hidden rows kept per sequence for the head (a long prompt keeps its last ones; so do
#: long stretches of plain decoding while the gate keeps speculation off). The memory bound:
#: `max_num_seqs * MAX_PENDING_ROWS * hidden_size` elements of the model dtype (Qwen3-8B:
#: 8 MiB a sequence), outside the KV budget.
MAX_PENDING_ROWS = 1024


@dataclass
class MtpPending:
    """Hidden rows of positions `[start, start + rows)` the head has not consumed, in the
    chunks the forwards produced (joined only when a propose consumes them)."""

    start: int
    chunks: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    @property
    def end(self) -> int:
        return self.start + self.rows

    def append(self, part: torch.Tensor) -> None:
        self.chunks.append(part)
        self.rows += int(part.shape[0])
        while self.rows - int(self.chunks[0].shape[0]) >= MAX_PENDING_ROWS:
            dropped = int(self.chunks.pop(0).shape[0])
            self.rows -= dropped
            self.start += dropped

    def cut(self, rows: int) -> None:
        """Keep the first `rows` rows."""
        kept: list[torch.Tensor] = []
        total = 0
        for c in self.chunks:
            if total >= rows:
                break
            take = min(int(c.shape[0]), rows - total)
            kept.append(c[:take])
            total += take
        self.chunks, self.rows = kept, total

    def joined(self) -> torch.Tensor:
        return self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)


def require_mtp_head(module: torch.nn.Module, source: str) -> None:
    """Refuse speculative method "mtp" for a module without an MTP head, naming `source`."""
    if not getattr(module, "has_mtp", False):
        raise InvalidRequestError(
            f"speculative method 'mtp' needs a checkpoint with MTP layers; {source} has none "
            "(no num_nextn_predict_layers in config.json, or no mtp.* tensors)",
            param="speculative_config.method",
        )


class MtpDrafting:
    """MTP drafting over `TransformerModel` (a mixin)."""

    module: torch.nn.Module
    kv_cache: PagedKVCache
    block_pool: BlockPool
    block_size: int
    device: torch.device
    #: Whether the MTP head drafts (its KV layers exist in `kv_cache`).
    mtp_enabled: bool
    #: Captured propose graphs by draft count k (CUDA; empty: every propose runs eagerly).
    mtp_graphs: dict[int, MtpGraphRunner]
    #: Proposes served by a graph and run eagerly (the slower path, counted).
    mtp_proposes: dict[str, int]

    if TYPE_CHECKING:  # provided by `TransformerModel`

        def fits_context(self, seq: SequenceState, new_tokens: int) -> bool: ...

        def blocks_needed(self, seq: SequenceState, new_tokens: int) -> int: ...

        def reclaim_prefix_blocks(self, n: int) -> int: ...

    @property
    def main_kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The main model's KV layers (the head's follow them)."""
        return self.kv_cache.layers[: self.module.kv_layer_count]

    @property
    def head_kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The MTP head's KV layers (after the main model's)."""
        return self.kv_cache.layers[self.module.kv_layer_count :]

    def has_proposer(self) -> bool:
        return self.mtp_enabled

    # ------------------------------------------------------------------ hidden rows

    def _keep_mtp_rows(
        self, rows: Sequence[ForwardRow], hidden: torch.Tensor | None, owned: bool
    ) -> None:
        """After a forward (before `_advance`): append each row's hidden rows (`hidden` holds
        every token row of the forward in order; None: the forward produced none); each
        sequence keeps a view of its rows. `owned`: nothing else writes `hidden` later (an
        eager forward's output); else (a graph's output buffer, overwritten by the next
        replay) one copy is taken for the whole forward."""
        if hidden is not None and not owned:
            hidden = hidden.clone()
        offset = 0
        for row in rows:
            n = len(row.tokens)
            part = None if hidden is None else hidden[offset : offset + n]
            offset += n
            self._append_mtp_rows(row.seq, row.start, n, part)

    @staticmethod
    def _append_mtp_rows(seq: SequenceState, start: int, n: int, part: torch.Tensor | None) -> None:
        pending = seq.proposer_state
        if part is None:  # no rows: the next ones start after these (a hole before them)
            seq.proposer_state = MtpPending(start + n)
            return
        if not isinstance(pending, MtpPending) or pending.end != start:
            seq.proposer_state = pending = MtpPending(start)  # a restart: a hole before it
        pending.append(part)

    def _cut_mtp_rows(self, seq: SequenceState) -> None:
        """Drop pending rows at or past `seq_len` (a verify's rejected drafts)."""
        pending = seq.proposer_state
        if not isinstance(pending, MtpPending):
            return
        keep = seq.seq_len - pending.start
        if keep <= 0:
            seq.proposer_state = MtpPending(seq.seq_len)
        elif keep < pending.rows:
            pending.cut(keep)

    # ------------------------------------------------------------------ propose

    @torch.inference_mode()
    def run_mtp_propose_batched(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        stash_idx: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceState],
        stream: Stream = None,
        out_conf: list[list[float]] | None = None,
    ) -> list[list[int]] | None:
        """Up to `num_drafts` drafts per sequence: `tokens[i]` is sequence i's newest
        committed token, at `positions[i]` (its `seq_len`: the next forward's first
        position). `stash_idx` is unused (the pending rows live with each sequence)."""
        del stash_idx, stream, out_conf
        if not self.mtp_enabled:
            return None
        return self.mtp_propose(seqs, tokens, [num_drafts] * len(seqs), positions)

    def mtp_propose(
        self,
        seqs: Sequence[SequenceState],
        newest: Sequence[int],
        max_drafts: Sequence[int],
        positions: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Drafts per sequence (see the invariants); a sequence without pending rows ending
        at its `seq_len`, or whose newest token is not at `seq_len`, gets none."""
        if not self.mtp_enabled:
            raise ValueError("this model was built without its MTP head drafting")
        out: list[list[int]] = [[] for _ in seqs]
        candidates: list[int] = []
        for i, seq in enumerate(seqs):
            pending = seq.proposer_state
            if positions is not None and positions[i] != seq.seq_len:
                continue
            if not isinstance(pending, MtpPending) or not pending.rows:
                continue
            if pending.end != seq.seq_len or max_drafts[i] < 1:
                continue
            if any(t == FED_TOKEN for t in seq.tokens[pending.start + 1 :]):
                continue
            candidates.append(i)
        if not candidates:
            return out
        if self._mtp_graphed(seqs, newest, max_drafts, candidates, out):
            self.mtp_proposes["graphed"] += 1
            return out
        self.mtp_proposes["eager"] += 1
        active: list[int] = []
        ks: list[int] = []
        for i in candidates:
            k = self._draft_room(seqs[i], max_drafts[i])
            if k >= 1:
                active.append(i)
                ks.append(k)
        if not active:
            return out
        head = self.module.mtp
        embed = self.module.input_embeddings()
        head_kv = self.head_kv_layers
        # Catch-up: every pending row, sequence by sequence (a varlen batch).
        rows: list[ForwardRow] = []
        hiddens: list[torch.Tensor] = []
        for i in active:
            seq = seqs[i]
            pending = seq.proposer_state
            assert isinstance(pending, MtpPending) and pending.rows
            nxt = [*seq.tokens[pending.start + 1 : seq.seq_len], int(newest[i])]
            rows.append(ForwardRow(seq, nxt, True, start_at=pending.start))
            hiddens.append(pending.joined())
        batch, normed, nxt_hidden = self._head_rows(rows, hiddens)
        last = batch.logits_indices
        drafts = self.module.compute_logits(normed.index_select(0, last)).argmax(dim=-1)
        hidden = nxt_hidden.index_select(0, last)
        for i in active:
            seqs[i].proposer_state = MtpPending(seqs[i].seq_len)
        draft_lists = [[t] for t in drafts.tolist()]
        # Further drafts: one head step per position, recursing on the head's hidden.
        for j in range(1, max(ks)):
            live = [n for n, k in enumerate(ks) if k > j]
            steps = [
                ForwardRow(seqs[active[n]], [draft_lists[n][-1]], True,
                           start_at=seqs[active[n]].seq_len + j - 1)
                for n in live
            ]  # fmt: skip
            batch = build_forward_batch(steps, len(steps), self.block_size, self.device)
            index = torch.tensor(live, dtype=torch.int64, device=hidden.device)
            normed, step_hidden = head(
                embed(batch.input_ids), hidden.index_select(0, index), batch.meta.positions,
                batch.meta, head_kv,
            )  # fmt: skip
            picked = self.module.compute_logits(normed).argmax(dim=-1).tolist()
            hidden = hidden.index_copy(0, index, step_hidden)
            for n, t in zip(live, picked, strict=True):
                draft_lists[n].append(int(t))
        for n, i in enumerate(active):
            out[i] = draft_lists[n]
        return out

    def _head_rows(
        self, rows: list[ForwardRow], hiddens: list[torch.Tensor]
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One eager head forward over varlen rows (`start_at` each): the batch, the normed
        rows and the rows a further head step reads."""
        batch = build_forward_batch(rows, 0, self.block_size, self.device)
        joined = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        embed = self.module.input_embeddings()
        normed, nxt = self.module.mtp(
            embed(batch.input_ids), joined, batch.meta.positions, batch.meta,
            self.head_kv_layers,
        )  # fmt: skip
        return batch, normed, nxt

    def _mtp_prefill_catch_up(self, rows: Sequence[ForwardRow]) -> None:
        """After a forward's prefill chunks (before `_advance`): feed the head every pending
        row whose next token is known now (all but each chunk's last row), so a prompt's
        context reaches the head in full, at prefill time, and the first propose after it is
        a steady-state one (a row or two)."""
        todo: list[ForwardRow] = []
        hiddens: list[torch.Tensor] = []
        for row in rows:
            seq, pending = row.seq, row.seq.proposer_state
            if not isinstance(pending, MtpPending) or pending.rows < 2:
                continue
            if pending.end != row.start + len(row.tokens):
                continue
            # Positions [pending.start, end - 1) pair with tokens [pending.start + 1, end).
            first = pending.start + 1
            known = [*seq.tokens[first : row.start], *row.tokens[max(0, first - row.start) :]]
            if any(t == FED_TOKEN for t in known):
                continue
            joined = pending.joined()
            todo.append(ForwardRow(seq, known, False, start_at=pending.start))
            hiddens.append(joined[: len(known)])
            last = MtpPending(pending.end - 1)
            last.append(joined[len(known) :])
            seq.proposer_state = last
        if todo:
            self._head_rows(todo, hiddens)

    def _mtp_graphed(
        self,
        seqs: Sequence[SequenceState],
        newest: Sequence[int],
        max_drafts: Sequence[int],
        candidates: list[int],
        out: list[list[int]],
    ) -> bool:
        """The propose through a captured graph (`mtp_graphs`), when one has the batch's k
        and every sequence fits it (see `mtp_graphs.py`); fills `out`. False: run eagerly."""
        wanted = max(max_drafts[i] for i in candidates)
        # The smallest captured k that covers every row (extra drafts are cut off below).
        k = min((k for k in self.mtp_graphs if k >= wanted), default=None)
        if k is None:
            return False
        runner = self.mtp_graphs[k]
        if not runner.can_run(len(candidates)):
            return False
        chosen = [seqs[i] for i in candidates]
        for seq in chosen:
            pending = seq.proposer_state
            assert isinstance(pending, MtpPending)
            if pending.rows > runner.q or not self.fits_context(seq, k + 1):
                return False
        need = [self.blocks_needed(seq, k) for seq in chosen]
        if not self._free_blocks_for_drafts(sum(need)):
            return False
        for seq, n in zip(chosen, need, strict=True):
            if n:
                seq.block_table.extend(self.block_pool.allocate(n))
        next_tokens: list[list[int]] = []
        hiddens: list[torch.Tensor] = []
        for i, seq in zip(candidates, chosen, strict=True):
            pending = seq.proposer_state
            assert isinstance(pending, MtpPending)
            next_tokens.append([*seq.tokens[pending.start + 1 : seq.seq_len], int(newest[i])])
            hiddens.append(pending.joined())
        drafts = runner.run(chosen, next_tokens, hiddens)
        for i, seq, d in zip(candidates, chosen, drafts, strict=True):
            out[i] = [int(t) for t in d[: max_drafts[i]]]
            seq.proposer_state = MtpPending(seq.seq_len)
        return True

    def _free_blocks_for_drafts(self, need: int) -> bool:
        """Whether `need` blocks are free, evicting prefix-cache blocks nobody holds when
        they are not (as a decode step that needs a block does)."""
        short = need - self.block_pool.num_free
        if short > 0:
            self.reclaim_prefix_blocks(short)
        return need <= self.block_pool.num_free

    def _draft_room(self, seq: SequenceState, k: int) -> int:
        """Drafts `seq` can take (at most `k`): the head writes positions up to
        `seq_len + k - 2`, and the verify needs `seq_len + k` within the context; blocks for
        the head's positions are taken now."""
        while k > 0 and not self.fits_context(seq, k + 1):
            k -= 1
        while k > 1:
            need = self.blocks_needed(seq, k - 1)
            if self._free_blocks_for_drafts(need):
                if need:
                    seq.block_table.extend(self.block_pool.allocate(need))
                break
            k -= 1
        return k

    # ------------------------------------------------------------ the seed's entry points

    def run_mtp_propose(
        self, token: int, position: int, seq: SequenceState, stream: Stream = None
    ) -> int | None:
        """One draft for `seq` (`token` is its newest token, at `position == seq_len`)."""
        drafts = self.mtp_propose([seq], [token], [1], [position])[0]
        return drafts[0] if drafts else None

    def run_mtp_propose_multi(
        self,
        token: int,
        position: int,
        num_drafts: int,
        seq: SequenceState,
        stream: Stream = None,
        grammar_bitmask: Any = None,
    ) -> list[int]:
        """Up to `num_drafts` drafts for one sequence. Grammar masks are refused: structured
        output does not exist yet (issue 17), so nothing could have made one."""
        if grammar_bitmask is not None:
            raise ValueError("MTP drafting under a grammar mask is not supported")
        return self.mtp_propose([seq], [token], [num_drafts], [position])[0]

    def run_mtp_catchup_batched(
        self,
        tokens: Sequence[int],
        first_slot: int,
        first_pos: Sequence[int],
        seqs: Sequence[SequenceState],
    ) -> int:
        """Feed the head every pending row of `seqs` (`tokens[i]`: sequence i's newest token)
        without drafting further; returns the rows consumed. A propose does this itself; this
        keeps the head's context current for sequences that are not speculating (their rows
        would otherwise wait, up to `MAX_PENDING_ROWS`). `first_slot` / `first_pos` are the
        seed's hidden-row ring coordinates, unused here (the rows live with each sequence)."""
        del first_slot, first_pos
        before = sum(p.rows for p in (pending_rows(s) for s in seqs) if p is not None)
        self.mtp_propose(seqs, tokens, [1] * len(seqs))
        after = sum(p.rows for p in (pending_rows(s) for s in seqs) if p is not None)
        return before - after

    def trim_proposer_state(
        self, seq: SequenceState, num_accepted: int, stream: Stream = None
    ) -> None:
        """Drop the head's pending rows past `seq_len` (`commit_accepted_prefix` does this
        after every verify; calling it again is harmless)."""
        if self.mtp_enabled:
            self._cut_mtp_rows(seq)

    def mtp_slot_draft_capacity(self, slot_idx: int) -> int:
        """Drafts a step may send to one sequence: no per-slot buffer bounds them here (the
        hybrid verify stash is sized per forward), so the configuration's cap."""
        return MAX_SPECULATIVE_TOKENS


def pending_rows(seq: SequenceState) -> MtpPending | None:
    """The sequence's pending hidden rows (tests and metrics)."""
    pending = seq.proposer_state
    return pending if isinstance(pending, MtpPending) else None
