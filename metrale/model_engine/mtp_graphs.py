"""`MtpGraphRunner`: an MTP propose of k drafts as one CUDA graph per batch rung: the head's
catch-up over each sequence's pending rows (padded to Q = k + 1 rows), then k - 1 recursive
head steps, each drafting with an on-device argmax; one read back at the end.

Owner: model-engine (`MtpDrafting.mtp_propose` routes steady-state proposes here; the
factory captures it, through `cuda_graphs.GraphCapture`, when the MTP head drafts on CUDA).

Invariants:
- A replay serves sequences whose pending rows number 1..Q and end at `seq_len`, each with
  blocks and context for positions up to `seq_len + k - 1` (the padding rows write the head's
  KV at positions `seq_len .. start + Q - 1`, the recursion at `seq_len .. seq_len + k - 2`:
  all past `seq_len`, so nothing valid is overwritten, and the next catch-up rewrites them
  before the head reads them). Anything else runs eagerly.
- Sequence b owns rows `b * Q .. b * Q + Q - 1`; its first draft comes from row
  `b * Q + r - 1` (its last pending row), and every recursive step reads that row's hidden.
- Padding sequences (past the real batch) take positions from 0 in the null block (block 0),
  as the decode graphs' padding does; their drafts are never read.
- Inputs reach the graph only through the runner's buffers; without a capture (`capture`
  not called: the CPU) the same body runs eagerly, so the buffer logic is testable anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from metrale.kernels.metadata import AttentionMetadata
from metrale.model_engine.cuda_graphs import GraphCapture
from metrale.model_engine.traits import DECODE_BATCH_LADDER, SequenceState, padded_batch_n

logger = logging.getLogger(__name__)


class MtpGraphRunner:
    def __init__(
        self,
        module: torch.nn.Module,
        head_kv: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        k: int,
    ) -> None:
        if k < 1:
            raise ValueError(f"an MTP propose drafts at least one token, got k={k}")
        self.module = module
        self.head_kv = head_kv
        self.device = device
        self.block_size = block_size
        self.k = k
        self.q = k + 1
        top = padded_batch_n(max_batch)
        self.rungs = sorted({1, *(r for r in DECODE_BATCH_LADDER if r <= top), top})
        n, q, width = self.rungs[-1], self.q, max_blocks_per_seq
        hidden_size = module.config.hidden_size
        self.ids = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n * q, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.last_rows = torch.zeros(n, dtype=torch.int64, device=device)
        self.bases = torch.zeros(n, dtype=torch.int64, device=device)
        self.qsl_rows = torch.arange(n + 1, dtype=torch.int32, device=device) * q
        self.qsl_step = torch.arange(n + 1, dtype=torch.int32, device=device)
        # ids, positions, slots (a row each), lengths, last rows, bases (a sequence each),
        # the block table, the rows that receive pending hidden rows: one pinned host buffer, one host-to-device copy a propose (the
        # propose reads its drafts back before the buffer is written again).
        pinned = device.type == "cuda"
        self._staging = torch.zeros(
            4 * n * q + 3 * n + n * width, dtype=torch.int64, pin_memory=pinned
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        #: Proposes served by this runner (a metric).
        self.replays = 0

    # ------------------------------------------------------------------ the graph body

    def _meta(self, rungs: int, positions: torch.Tensor, slots: torch.Tensor,
              lens: torch.Tensor, query_len: int) -> AttentionMetadata:  # fmt: skip
        return AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            query_start_loc=(self.qsl_rows if query_len > 1 else self.qsl_step)[: rungs + 1],
            seq_lens=lens,
            block_tables=self.block_tables[:rungs],
            num_decode=rungs,
            query_lens_host=[query_len] * rungs,
            seq_lens_host=[],  # not available inside a graph
            max_query_len=query_len,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
            decode_query_len=query_len,
        )

    def _body(self, rungs: int) -> torch.Tensor:
        module, head, bs = self.module, self.module.mtp, self.block_size
        embed = module.input_embeddings()
        tokens = rungs * self.q
        meta = self._meta(
            rungs, self.positions[:tokens], self.slots[:tokens], self.seq_lens[:rungs], self.q
        )
        normed, nxt = head(
            embed(self.ids[:tokens]), self.hidden[:tokens], self.positions[:tokens], meta,
            self.head_kv,
        )  # fmt: skip
        last = self.last_rows[:rungs]
        draft = module.compute_logits(normed.index_select(0, last)).argmax(dim=-1)
        hidden = nxt.index_select(0, last)
        drafts = [draft]
        tables = self.block_tables[:rungs]
        for j in range(1, self.k):
            pos = self.bases[:rungs] + (j - 1)
            block = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).to(torch.int64)
            slots = block * bs + pos % bs
            meta = self._meta(rungs, pos, slots, (pos + 1).to(torch.int32), 1)
            normed, hidden = head(embed(draft), hidden, pos, meta, self.head_kv)
            draft = module.compute_logits(normed).argmax(dim=-1)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def capture(self) -> None:
        capture = GraphCapture(self.device)
        with capture.session():
            for rungs in reversed(self.rungs):
                graph, self.outputs[rungs] = capture.graph(lambda rungs=rungs: self._body(rungs))
                self.graphs[rungs] = graph
        self.capture_seconds = capture.seconds
        self.capture_bytes = capture.bytes
        logger.info(
            "captured %d MTP propose graphs (k=%d, batch %s) in %.2fs using %.1f MiB",
            len(self.graphs), self.k, ",".join(map(str, self.rungs)), self.capture_seconds,
            self.capture_bytes / 2**20,
        )  # fmt: skip

    # ------------------------------------------------------------------ a propose

    def can_run(self, rows: int) -> bool:
        return 0 < rows <= self.rungs[-1]

    @torch.inference_mode()
    def run(
        self,
        seqs: Sequence[SequenceState],
        next_tokens: Sequence[Sequence[int]],
        hiddens: Sequence[torch.Tensor],
    ) -> list[list[int]]:
        """k drafts per sequence: `next_tokens[b]` are the tokens its pending rows pair with
        (1..Q of them), `hiddens[b]` those rows (`[r, hidden]`)."""
        rows, q, bs = len(seqs), self.q, self.block_size
        rungs = next(r for r in self.rungs if r >= rows)
        total = rungs * q
        width = self.block_tables.shape[1]
        stage = self._staging.numpy()
        ids, positions, slots = stage[: 3 * total].reshape(3, total)
        lens, last, bases = stage[3 * total : 3 * total + 3 * rungs].reshape(3, rungs)
        end = 3 * total + 3 * rungs + rungs * width
        tables = stage[3 * total + 3 * rungs : end].reshape(rungs, width)
        # Padding sequences: positions 0.. in the null block (table row 0 everywhere).
        ids[:] = 0
        positions[:] = np.tile(np.arange(q, dtype=np.int64), rungs)
        slots[:] = positions % bs
        lens[:] = q
        last[:] = np.arange(rungs, dtype=np.int64) * q
        bases[:] = q
        tables[:] = 0
        count = 0
        index = stage[end : end + total]
        for b, (seq, nxt) in enumerate(zip(seqs, next_tokens, strict=True)):
            r = len(nxt)
            if not 1 <= r <= q:
                raise ValueError(f"an MTP graph takes 1..{q} pending rows, got {r}")
            start = seq.seq_len - r
            tables[b, : len(seq.block_table)] = seq.block_table
            pos = np.arange(start, start + q, dtype=np.int64)
            a = b * q
            ids[a : a + r] = nxt
            positions[a : a + q] = pos
            slots[a : a + q] = tables[b, pos // bs] * bs + pos % bs
            lens[b] = start + q
            last[b] = a + r - 1
            bases[b] = seq.seq_len
            index[count : count + r] = np.arange(a, a + r)
            count += r
        staged = self._staging[: end + count].to(self.device, non_blocking=True)
        self.ids[:total].copy_(staged[:total])
        self.positions[:total].copy_(staged[total : 2 * total])
        self.slots[:total].copy_(staged[2 * total : 3 * total])
        per_seq = staged[3 * total : 3 * total + 3 * rungs].view(3, rungs)
        self.seq_lens[:rungs].copy_(per_seq[0])
        self.last_rows[:rungs].copy_(per_seq[1])
        self.bases[:rungs].copy_(per_seq[2])
        self.block_tables[:rungs].copy_(staged[3 * total + 3 * rungs : end].view(rungs, width))
        joined = hiddens[0] if len(hiddens) == 1 else torch.cat(list(hiddens))
        self.hidden.index_copy_(0, staged[end:], joined.to(self.hidden.dtype))
        graph = self.graphs.get(rungs)
        if graph is not None:
            graph.replay()
            out = self.outputs[rungs]
        else:  # not captured (the CPU): the same body, eagerly
            out = self._body(rungs)
        self.replays += 1
        return out[:rows].tolist()
