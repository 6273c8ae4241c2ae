"""The forward paths that spare the host: the device token feed (a decode step whose input
tokens are the previous step's sampled ids, still on the device), decode-graph replays,
which also take a forward of one-token prompt chunks, and on the CPU the fused decode step
run straight from the rows' host lists (no forward batch built).

Owner: model-engine (a mixin of `TransformerModel`; the graphs are `cuda_graphs.py`'s).

Invariants:
- A fed decode step advances its sequences as any forward does and records `FED_TOKEN` at the
  new position until the scheduler's commit writes the real id; every source names a row of
  the previous step's tokens.
- A graph replay computes what the eager forward would for its rows: one-token prompt chunks
  replay it only where nothing differs (no recurrent state to start, no MTP head to feed, no
  image rows, no pooling, no per-position logits, no device feed), counted in
  `graphed_prompt_chunks`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from metrale.cache.hss import HostKvPool
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.kernels.cpu_decode import MAX_ROWS as FUSED_MAX_ROWS
from metrale.kernels.cpu_decode import CpuDecodeStack
from metrale.model_engine.batch import ForwardRow, plain_decode_rows
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from metrale.model_engine.lora import LoraManager
from metrale.model_engine.traits import FED_TOKEN, FeedSource, SequenceState, Stream


def fed_ids(tokens: torch.Tensor, from_rows: list[int]) -> torch.Tensor:
    """The input ids of fed decode rows: row `i` reads `tokens[from_rows[i]]` (the previous
    step's sampled ids, on the device), read in place when every row reads its own."""
    n = len(from_rows)
    if tokens.shape[0] == n and from_rows == list(range(n)):
        return tokens
    index = torch.tensor(from_rows, dtype=torch.int64).to(tokens.device, non_blocking=True)
    return tokens.index_select(0, index)


class FastForwards:
    """The device token feed, decode-graph replays and the CPU's fused step from host lists
    of a `TransformerModel`."""

    graph_runner: DecodeGraphRunner | None
    cpu_decode: CpuDecodeStack | None
    device: torch.device
    hss: HostKvPool | None
    lora: LoraManager | None
    ssm_pool: SsmSlotPool | None
    mtp_enabled: bool
    graphed_prompt_chunks: int
    _last_hidden: torch.Tensor | None

    def supports_device_token_feed(self) -> bool:
        return True

    def decode_batch_fed(
        self,
        sources: Sequence[FeedSource],
        seqs: Sequence[SequenceState],
        stream: Stream = None,
        *,
        feed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A decode step whose input tokens are read on the device: row `i`'s token is
        `feed[sources[i].from_row]`, `feed` being the previous step's sampled token ids
        `[rows]` int64, which the host has not read yet. Returns `[rows, vocab]` logits.

        Unlike the seed (which defers it to the commit), the sequences advance here as after
        any forward (`seq_len`, `kv_valid_tokens`, a block when one fills); `tokens` records
        `FED_TOKEN` at the new position until the scheduler's commit of the previous step
        writes the real id. Every source must be a `from_row` one."""
        if feed is None:
            raise ValueError("decode_batch_fed needs `feed`, the previous step's token ids")
        if len(sources) != len(seqs):
            raise ValueError("sources and seqs differ in length")
        if not seqs:
            raise ValueError("decode_batch_fed needs at least one row")
        from_rows = []
        for src in sources:
            if src.from_row is None or not 0 <= src.from_row < feed.shape[0]:
                raise ValueError(
                    f"a fed row must name a row of the previous step's {feed.shape[0]} tokens "
                    f"(got from_row={src.from_row!r}); host tokens go through decode_batch"
                )
            from_rows.append(src.from_row)
        rows = [ForwardRow(s, [FED_TOKEN], True) for s in seqs]
        self._check_ssm_states(rows)
        self._allocate_blocks(rows)
        logits, _ = self._forward(rows, len(rows), (feed, from_rows))
        self._advance(rows)
        self._capture_after_forward(rows)
        return logits

    def _graphable_chunks(
        self, rows: list[ForwardRow], feed: tuple[torch.Tensor, list[int]] | None
    ) -> bool:
        """Whether this forward's prompt chunks may replay the decode graph: each is one token
        (a prefix-cache or KV-tier hit up to the prompt's last token) at the sequence's own
        position, wanting at most that token's logits, on a model whose decode graph computes
        what the eager prefill would (no recurrent state to start, no MTP head to feed, no
        image rows, no pooled hidden states), and no row's input comes from the device feed."""
        if feed is not None or self.ssm_pool is not None or self.mtp_enabled:
            return False
        return all(
            len(r.tokens) == 1
            and r.start_at is None
            and not r.all_logits
            and r.ssm_verify is None
            and r.seq.pooling is None
            and r.seq.vision is None
            for r in rows
        )

    def _forward_graphed(
        self,
        runner: DecodeGraphRunner,
        rows: list[ForwardRow],
        feed: tuple[torch.Tensor, list[int]] | None,
    ) -> torch.Tensor:
        """A decode-only forward replayed from the captured graph of its padded width."""
        if feed is not None:
            tokens = np.asarray(feed[1], dtype=np.int64)  # source rows, gathered on device
        else:
            tokens = np.fromiter((r.tokens[0] for r in rows), dtype=np.int64, count=len(rows))
        positions = np.fromiter((r.seq.seq_len for r in rows), dtype=np.int64, count=len(rows))
        width = max(len(r.seq.block_table) for r in rows)
        tables = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            tables[i, : len(r.seq.block_table)] = r.seq.block_table
        self._last_hidden = None
        adapters = None
        if runner.lora is not None:
            adapters = np.fromiter((r.seq.adapter_slot for r in rows), np.int64, len(rows))
        rope = self._vision_shifted_positions([r.seq for r in rows], positions)
        ssm_slots = None
        if self.ssm_pool is not None:
            ssm_slots = np.fromiter(
                (r.seq.ssm_slot_idx() for r in rows), dtype=np.int64, count=len(rows)
            )
        logits = runner.run(
            tokens, positions, tables, feed[0] if feed is not None else None,
            adapter_slots=adapters, rope_positions=rope, ssm_slots=ssm_slots,
        )  # fmt: skip
        if self.mtp_enabled:
            self._keep_mtp_rows(rows, runner.head_hidden(len(rows), 1), owned=False)
        return logits

    def _fused_decode_rows(
        self,
        rows: list[ForwardRow],
        num_decode: int,
        feed: tuple[torch.Tensor, list[int]] | None,
    ) -> torch.Tensor | None:
        """The final hidden states of a forward the CPU's fused step takes whole (one-token
        decode rows of resident blocks, on the base text model: what `_forward` would run
        through it from the batch it builds), computed from the rows' host lists without
        that batch; None for any other forward (it takes the general path)."""
        fused = self.cpu_decode
        if (
            fused is None
            or num_decode != len(rows)
            or not 0 < len(rows) <= FUSED_MAX_ROWS
            or self.device.type != "cpu"
            or self.hss is not None
            or self.ssm_pool is not None
            or self.lora is not None
            or self.mtp_enabled
            or (feed is not None and len(feed[1]) != len(rows))
            or self._vision_rows_present(rows)
            or not plain_decode_rows(rows)
        ):
            return None
        if feed is None:
            input_ids = torch.tensor([r.tokens[0] for r in rows], dtype=torch.int64)
        else:
            input_ids = fed_ids(*feed)
        return fused.decode_rows(
            input_ids, [r.start for r in rows], [r.seq.block_table for r in rows]
        )
