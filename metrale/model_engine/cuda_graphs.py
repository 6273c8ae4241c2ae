"""CUDA graphs for decode: one graph per rung of `DECODE_BATCH_LADDER` (plus batch 1), captured
at startup into one memory pool, replayed with persistent input buffers.

Owner: model-engine (`TransformerModel` routes decode-only forwards here when graphs exist).

Invariants:
- A graph is replayed only for a forward whose rows are all single-token decode rows and whose
  count fits a captured rung; everything else runs eagerly.
- Inputs reach the graph only through the persistent buffers; rows past the real batch are
  padding: token 0 (a fed replay: the previous step's row-0 token) at position 0, writing
  its K/V to slot 0 of the null block, attending to that slot alone, and its logits row is
  never read.
- Block-table columns past a row's current block count are stale but never read: the
  attention kernels stop at `seq_lens`.
- The attention op must be capturable (no host reads); graphs are refused otherwise.
- Host inputs travel through two pinned staging buffers used in turn, one contiguous copy
  per step: a step's buffer is rewritten only two steps later, after that step's results
  were read back, so a step launched while the previous one is still queued (the device
  token feed) never changes the previous step's inputs under it.
- The block table is sent only when it differs from the one the device buffer last received
  (stream order makes the buffer hold it when the replay runs).
- A fed replay's input ids are gathered on the device from the previous step's token ids.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from metrale.kernels.metadata import AttentionMetadata
from metrale.model_engine.traits import DECODE_BATCH_LADDER, padded_batch_n

logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    def __init__(
        self,
        module: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
    ) -> None:
        self.module = module
        self.kv_layers = kv_layers
        self.device = device
        self.block_size = block_size
        top = padded_batch_n(max_batch)
        self.rungs = sorted({1, *(r for r in DECODE_BATCH_LADDER if r <= top), top})
        self.max_rows = self.rungs[-1]
        n, width = self.max_rows, max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        size = 4 * n + n * width  # ids, positions, slots, lengths, then the block table
        self._staging = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        #: The block table last sent to the device buffer, to skip re-sending it (its row
        #: count fixes the rung, so an equal table means an equal buffer).
        self._sent_tables: np.ndarray | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        #: Forwards served by a graph replay (a metric: eager fallbacks are the rest).
        self.replays = 0

    def _meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            num_decode=rows,
            query_lens_host=[1] * rows,
            seq_lens_host=[],  # not available inside a graph: kernels must not read it
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
        )

    def _body(self, rows: int) -> torch.Tensor:
        hidden = self.module(
            self.input_ids[:rows], self.positions[:rows], self._meta(rows), self.kv_layers
        )
        return self.module.compute_logits(hidden).float()

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for rows in reversed(self.rungs):
                for _ in range(2):  # warm-up: autotuning, lazy init, allocator
                    self._body(rows)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[rows] = self._body(rows)
                self.graphs[rows] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_allocated(self.device) - before
        logger.info(
            "captured %d decode graphs (batch %s) in %.2fs using %.1f MiB",
            len(self.graphs), ",".join(map(str, self.rungs)), self.capture_seconds,
            self.capture_bytes / 2**20,
        )  # fmt: skip

    def can_run(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows

    @torch.inference_mode()
    def run(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        tables: np.ndarray,
        feed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay for `len(tokens)` decode rows; returns their `[rows, vocab]` float32 logits.
        `tables` is `[rows, blocks]` (the blocks each row holds, 0-padded). With `feed` (the
        previous step's token ids on the device), `tokens` are row indices into it."""
        rows = len(tokens)
        rung = next(r for r in self.rungs if r >= rows)
        bs = self.block_size
        slots = tables[np.arange(rows), positions // bs] * bs + positions % bs
        staging = self._staging[self._turn]
        self._turn ^= 1
        stage = staging.numpy()
        cols = stage[: 4 * rung].reshape(4, rung)
        cols[:, rows:] = 0
        cols[3, rows:] = 1
        cols[0, :rows] = tokens
        cols[1, :rows] = positions
        cols[2, :rows] = slots
        cols[3, :rows] = positions + 1
        # The block table changes only when a row gains a block: most steps skip it.
        sent = self._sent_tables
        send_tables = not (
            sent is not None and sent.shape == tables.shape and np.array_equal(sent, tables)
        )
        end = 4 * rung
        width = tables.shape[1]
        if send_tables:
            end += rows * width
            stage[4 * rung : end] = tables.reshape(-1)
            self._sent_tables = tables.copy()
        # One pinned host-to-device copy of a contiguous prefix, then device-side copies.
        staged = staging[:end].to(self.device, non_blocking=True)
        ids = staged[:rung]
        if feed is None:
            self.input_ids[:rung].copy_(ids)
        else:  # padding rows read row 0: any token will do for them
            torch.index_select(feed, 0, ids, out=self.input_ids[:rung])
        self.positions[:rung].copy_(staged[rung : 2 * rung])
        self.slot_mapping[:rung].copy_(staged[2 * rung : 3 * rung])
        self.seq_lens[:rung].copy_(staged[3 * rung : 4 * rung])
        if send_tables:
            self.block_tables[:rows, :width].copy_(staged[4 * rung :].view(rows, width))
            if rung > rows:
                self.block_tables[rows:rung, 0].zero_()
        if self.graphs:
            self.graphs[rung].replay()
            self.replays += 1
            return self.outputs[rung][:rows]
        # Not captured (a CPU check of the buffer logic): run the same body eagerly.
        return self._body(rung)[:rows]
