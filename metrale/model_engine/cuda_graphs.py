"""CUDA graphs for decode: one graph per rung of `DECODE_BATCH_LADDER` (plus batch 1) and per
query length Q (1: decode; k + 1: a speculative verify step of k draft tokens), captured at
startup into one memory pool, replayed with persistent input buffers.

Owner: model-engine (`TransformerModel` routes decode-only forwards here when graphs exist).
`GraphCapture` is the capture session of every graph runner here and in `mtp_graphs.py`:
side stream, one pool, two warm-up runs per graph, then wait, sync and measure.

Invariants:
- A graph is replayed only for a forward whose sequences all take the same number Q of
  consecutive token rows (Q = 1: single-token decode rows; Q > 1: `run_verify`), with a
  captured Q, and whose sequence count fits a captured rung; everything else runs eagerly.
  Graphs are keyed by (rung, Q); sequence b owns token rows `b * Q .. b * Q + Q - 1`
  (`AttentionMetadata.decode_query_len = Q`).
- Inputs reach the graph only through the persistent buffers (token-row buffers sized for
  `max_rows * max(query_lens)`); sequences past the real batch are padding: tokens 0 (a fed
  replay: the previous step's row-0 token) at positions 0 .. Q-1, writing their K/V to
  slots 0 .. Q-1 of the null block, attending to those slots alone, and their logits rows
  are never read.
- Block-table columns past a row's current block count are stale but never read: the
  attention kernels stop at `seq_lens`.
- The attention op must be capturable (no host reads); graphs are refused otherwise.
- Host inputs travel through two pinned staging buffers used in turn, one contiguous copy
  per step: a step's buffer is rewritten only two steps later, after that step's results
  were read back, so a step launched while the previous one is still queued (the device
  token feed) never changes the previous step's inputs under it.
- The block table is sent only when it differs from the one the device buffer last received
  (stream order makes the buffer hold it when the replay runs) and the padding rows' null
  columns already cover the step's Q.
- A fed replay's input ids are gathered on the device from the previous step's token ids.
- With LoRA (`lora`), every graph runs the adapters' op on every adapted projection (the
  gather op, the tiled op over the device plan, or at the GEMV's rows `lora_linear`, the
  expand folded into the projection: `layers/lora.py`), reading each token row's slot from `lora_token_slots` (padding and base rows: -1, no
  delta); without it, a replay whose rows select a slot is refused, never run as the base.
- Hybrid models (`ssm_layers`): the recurrent layers read each sequence's SSM pool slot from
  the persistent `ssm_slots` buffer (a graph input, staged with the other inputs); padding
  sequences get slot -1, which the recurrent decode kernels skip (they write no state), so a
  padded rung never touches a real slot. Only Q = 1 graphs are built for them: a recurrent
  verify runs token by token with host-side captures (`recurrent_verify.py`), eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import torch

from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.lora import LoraBatch, LoraSlots
from metrale.model_engine.traits import DECODE_BATCH_LADDER, blocks_for, padded_batch_n

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The recurrent layers' decode ops: a hybrid model is graphed only when all are Triton kernels
#: (they skip a padding row's slot -1 and read no host values).
RECURRENT_DECODE_OPS = ("causal_conv1d_update", "mamba2_state_update", "gated_delta_update")


#: Capture mode of every graph: "thread_local", so only this thread's own unsafe CUDA calls
#: can invalidate its capture. Under torch's default ("global") any other thread of the
#: process that allocates, syncs or queries an event meanwhile breaks it: data-parallel
#: replicas are built (and capture) on parallel threads, and an engine thread of another
#: engine in the same process keeps stepping (the GPU tier saw the host-tier test's capture
#: fail after earlier modules' engines, and pass alone).
CAPTURE_MODE = "thread_local"


class GraphCapture:
    """One capture session (every graph runner uses it): graphs captured on a side stream
    into one memory pool; on leaving, the default stream waits for the side stream, the
    device syncs, and `seconds` and `bytes` hold the session's wall time and memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: object = None
        self.stream: torch.cuda.Stream | None = None
        self.seconds = 0.0
        self.bytes = 0

    @contextmanager
    def session(self) -> Iterator[GraphCapture]:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        stream = self.stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield self
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - start
        self.bytes = torch.cuda.memory_allocated(self.device) - before

    def graph(self, body: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """`body` run twice (warm-up: autotuning, lazy init, allocator), then captured into
        the session's pool; the graph and the outputs its replays rewrite."""
        for _ in range(2):
            body()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self.pool, stream=self.stream, capture_error_mode=CAPTURE_MODE
        ):
            out = body()
        return graph, out


class DecodeGraphRunner:
    def __init__(
        self,
        module: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        query_lens: Sequence[int] = (1,),
        verify_max_batch: int | None = None,
        head_hidden: bool = False,
        lora: LoraSlots | None = None,
        ssm_layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """`query_lens`: the token rows per sequence to capture graphs for (1: decode; k + 1:
        verify steps of k draft tokens), e.g. `(1, 5)`; `verify_max_batch` caps the batch
        rungs captured for Q > 1 (each keeps a `[rung * Q, vocab]` logits output), None:
        every rung. `head_hidden`: the graphs also output the hidden rows an MTP head reads
        (`module.forward_for_mtp`), read back by `head_hidden()` after a replay. `lora`: the
        model's LoRA slots; the graphs then add each row's adapter delta by the gather op,
        reading the per-row slot from a persistent buffer (a graph input). `ssm_layers`: a
        hybrid model's SSM pool tensors (`(conv, ssm)` per recurrent layer); the graphs then
        read each sequence's pool slot from a persistent buffer (Q = 1 only)."""
        if not query_lens or min(query_lens) < 1:
            raise ValueError(f"query_lens must be positive, got {tuple(query_lens)}")
        if ssm_layers is not None and max(query_lens) > 1:
            raise ValueError(
                "verify graphs (Q > 1) are not built for recurrent layers: their verify runs "
                "token by token, eagerly"
            )
        self.module = module
        self.kv_layers = kv_layers
        self.device = device
        self.block_size = block_size
        self.query_lens = sorted(set(query_lens))
        top = padded_batch_n(max_batch)
        self.rungs = sorted({1, *(r for r in DECODE_BATCH_LADDER if r <= top), top})
        self.max_rows = self.rungs[-1]
        verify_top = self.max_rows if verify_max_batch is None else padded_batch_n(verify_max_batch)
        #: The rungs captured for each Q (Q = 1: all of them).
        self.rungs_for = {
            q: self.rungs if q == 1 else [r for r in self.rungs if r <= verify_top]
            for q in self.query_lens
        }
        n, width = self.max_rows, max_blocks_per_seq
        tokens = n * self.query_lens[-1]
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.lora = lora
        #: Each token row's LoRA slot (-1: the base model); a graph input when `lora` is set.
        self.lora_token_slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.ssm_layers = ssm_layers
        #: Each sequence's SSM pool slot (-1: padding, no state written); a graph input with
        #: `ssm_layers`.
        self.ssm_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        #: Per Q: `query_start_loc` of Q rows per sequence (constant, never rewritten).
        self.query_start_locs = {
            q: torch.arange(n + 1, dtype=torch.int32, device=device) * q for q in self.query_lens
        }
        pinned = device.type == "cuda"
        # ids, positions, slots (a token row each), lengths (a sequence each), LoRA slots (a
        # token row each, with `lora`), SSM slots (a sequence each, with `ssm_layers`), the
        # block table
        size = 4 * tokens + 2 * n + n * width
        self._staging = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        #: The block table last sent to the device buffer, to skip re-sending it (its row
        #: count fixes the rung, so an equal table means an equal buffer), and how many of
        #: the padding rows' first columns were zeroed with it.
        self._sent_tables: np.ndarray | None = None
        self._sent_null_cols = 0
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_head_hidden = head_hidden
        #: Per graph, the hidden rows for an MTP head (when `head_hidden`).
        self.head_outputs: dict[tuple[int, int], torch.Tensor] = {}
        #: The (rung, Q) of the last replay, whose head rows `head_hidden()` returns.
        self._last_key: tuple[int, int] | None = None
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        #: Forwards served by a graph replay (a metric: eager fallbacks are the rest).
        self.replays = 0

    @property
    def query_start_loc(self) -> torch.Tensor:
        """The decode (Q = 1) `query_start_loc` buffer, when Q = 1 is captured."""
        return self.query_start_locs[1]

    def _meta(self, rows: int, query_len: int = 1) -> AttentionMetadata:
        tokens = rows * query_len
        return AttentionMetadata(
            positions=self.positions[:tokens],
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.query_start_locs[query_len][: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            num_decode=rows,
            query_lens_host=[query_len] * rows,
            seq_lens_host=[],  # not available inside a graph: kernels must not read it
            max_query_len=query_len,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
            decode_query_len=query_len,
            ssm_slots=self.ssm_slots[:rows] if self.ssm_layers is not None else None,
        )

    def _body(self, rows: int, query_len: int = 1) -> torch.Tensor:
        tokens = rows * query_len
        args = (
            self.input_ids[:tokens],
            self.positions[:tokens],
            self._meta(rows, query_len),
            self.kv_layers,
        )
        kwargs = {} if self.ssm_layers is None else {"ssm_states": self.ssm_layers}
        if self.lora is not None:
            self.lora.batch = LoraBatch(self.lora_token_slots[:tokens], None)
        try:
            if self.capture_head_hidden:
                hidden, for_head = self.module.forward_for_mtp(*args, **kwargs)
                self.head_outputs[rows, query_len] = for_head
            else:
                hidden = self.module(*args, **kwargs)
        finally:
            if self.lora is not None:
                self.lora.batch = None
        return self.module.compute_logits(hidden).float()

    def head_hidden(self, rows: int, query_len: int) -> torch.Tensor | None:
        """The MTP head's hidden rows of the last replay (`rows * query_len` of them, the
        graph's layout), or None when the graphs do not output them."""
        key = self._last_key
        if not self.capture_head_hidden or key is None or key[1] != query_len:
            return None
        return self.head_outputs[key][: rows * query_len]

    @torch.inference_mode()
    def capture(self) -> None:
        capture = GraphCapture(self.device)
        with capture.session():
            # Largest token counts first, so smaller graphs reuse the pool's blocks.
            for query_len in reversed(self.query_lens):
                q_before = torch.cuda.memory_allocated(self.device)
                for rows in reversed(self.rungs_for[query_len]):
                    graph, self.outputs[rows, query_len] = capture.graph(
                        lambda rows=rows, query_len=query_len: self._body(rows, query_len)
                    )
                    self.graphs[rows, query_len] = graph
                logger.info(
                    "captured %d decode graphs for Q=%d (batch %s, %d token rows at most): "
                    "%.1f MiB",
                    len(self.rungs_for[query_len]), query_len,
                    ",".join(map(str, self.rungs_for[query_len])),
                    self.max_rows * query_len,
                    (torch.cuda.memory_allocated(self.device) - q_before) / 2**20,
                )  # fmt: skip
        self.pool = capture.pool
        self.capture_seconds = capture.seconds
        self.capture_bytes = capture.bytes
        logger.info(
            "captured %d decode graphs (batch x Q: %s) in %.2fs using %.1f MiB",
            len(self.graphs),
            " ".join(f"{r}x{q}" for q in self.query_lens for r in self.rungs_for[q]),
            self.capture_seconds, self.capture_bytes / 2**20,
        )  # fmt: skip

    def can_run(self, rows: int, query_len: int = 1) -> bool:
        rungs = self.rungs_for.get(query_len)
        return rungs is not None and 0 < rows <= rungs[-1]

    @torch.inference_mode()
    def run(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        tables: np.ndarray,
        feed: torch.Tensor | None = None,
        adapter_slots: np.ndarray | None = None,
        rope_positions: np.ndarray | None = None,
        ssm_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Replay for `len(tokens)` decode rows; returns their `[rows, vocab]` float32 logits.
        `tables` is `[rows, blocks]` (the blocks each row holds, 0-padded). With `feed` (the
        previous step's token ids on the device), `tokens` are row indices into it.
        `adapter_slots`: each row's LoRA slot (-1: base; None: all base). `rope_positions`:
        the positions the rotary reads when they differ from the cache positions (M-RoPE after
        an image: `position + delta`); slots and lengths always follow `positions`.
        `ssm_slots`: each row's SSM pool slot (required with `ssm_layers`)."""
        rows = len(tokens)
        bs = self.block_size
        slots = tables[np.arange(rows), positions // bs] * bs + positions % bs
        rope = positions if rope_positions is None else rope_positions
        return self._replay(
            1, tokens, rope, slots, positions + 1, tables, feed, adapter_slots, ssm_slots
        )

    @torch.inference_mode()
    def run_verify(
        self,
        tokens: np.ndarray,
        start_positions: np.ndarray,
        tables: np.ndarray,
        adapter_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Replay a verify step: `tokens` `[rows, Q]` int64 (each sequence's last token and
        its Q - 1 draft tokens), `start_positions` `[rows]` (the position of each row's
        first token), `tables` `[rows, blocks]` (0-padded, covering every position up to
        `start + Q - 1`). Returns the `[rows * Q, vocab]` float32 logits, row-major (row
        `b * Q + j` is token j of sequence b)."""
        rows, query_len = tokens.shape
        if len(start_positions) != rows or len(tables) != rows:
            raise ValueError("tokens, start_positions and tables need one row per sequence")
        bs = self.block_size
        positions = start_positions[:, None] + np.arange(query_len)[None, :]
        slots = tables[np.arange(rows)[:, None], positions // bs] * bs + positions % bs
        lens = start_positions + query_len
        return self._replay(
            query_len, tokens.reshape(-1), positions.reshape(-1), slots.reshape(-1), lens,
            tables, None, adapter_slots,
        )  # fmt: skip

    def _replay(
        self,
        query_len: int,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        lens: np.ndarray,
        tables: np.ndarray,
        feed: torch.Tensor | None,
        adapter_slots: np.ndarray | None = None,
        ssm_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Stage one step's flat token rows (`rows * query_len` of them) and per-sequence
        lengths, tables and LoRA slots, then replay the (rung, Q) graph (or run its body
        uncaptured)."""
        if query_len not in self.query_lens:
            raise ValueError(f"no decode graphs for Q={query_len} (have {self.query_lens})")
        rows = len(lens)
        if not self.can_run(rows, query_len):
            raise ValueError(f"{rows} rows do not fit a rung captured for Q={query_len}")
        if (ssm_slots is None) != (self.ssm_layers is None):
            raise ValueError(
                "SSM slots go with the graphs of a hybrid model, and only with them "
                f"(graphs {'with' if self.ssm_layers is not None else 'without'} SSM layers)"
            )
        if ssm_slots is not None and (len(ssm_slots) != rows or (ssm_slots < 0).any()):
            raise ValueError(f"ssm_slots must name one pool slot (>= 0) for each of {rows} rows")
        rung = next(r for r in self.rungs_for[query_len] if r >= rows)
        real, total = rows * query_len, rung * query_len
        staging = self._staging[self._turn]
        self._turn ^= 1
        stage = staging.numpy()
        cols = stage[: 3 * total].reshape(3, total)
        # Padding sequences: token j at position j, slot j of the null block (table row 0).
        pad = np.arange(total - real) % query_len
        cols[0, real:] = 0
        cols[1, real:] = pad
        cols[2, real:] = pad % self.block_size
        cols[0, :real] = tokens
        cols[1, :real] = positions
        cols[2, :real] = slots
        stage_lens = stage[3 * total : 3 * total + rung]
        stage_lens[rows:] = query_len
        stage_lens[:rows] = lens
        # The block table changes only when a row gains a block: most steps skip it.
        null_cols = blocks_for(query_len, self.block_size)  # padding rows read these columns
        sent = self._sent_tables
        send_tables = not (
            sent is not None
            and sent.shape == tables.shape
            and np.array_equal(sent, tables)
            and (rung == rows or self._sent_null_cols >= null_cols)
        )
        end = 3 * total + rung
        lora_at = end
        if self.lora is not None:
            routed = stage[end : end + total]
            routed[:] = -1
            if adapter_slots is not None:
                routed[:real] = np.repeat(np.asarray(adapter_slots, dtype=np.int64), query_len)
            end += total
        elif adapter_slots is not None and (np.asarray(adapter_slots) >= 0).any():
            raise ValueError("a row selects a LoRA slot but the graphs were captured without LoRA")
        ssm_at = end
        if ssm_slots is not None:
            stage_ssm = stage[end : end + rung]
            stage_ssm[rows:] = -1
            stage_ssm[:rows] = ssm_slots
            end += rung
        width = tables.shape[1]
        tables_at = end
        if send_tables:
            stage[end : end + rows * width] = tables.reshape(-1)
            end += rows * width
            self._sent_tables = tables.copy()
            self._sent_null_cols = null_cols
        # One pinned host-to-device copy of a contiguous prefix, then device-side copies.
        staged = staging[:end].to(self.device, non_blocking=True)
        ids = staged[:total]
        if feed is None:
            self.input_ids[:total].copy_(ids)
        else:  # padding rows read row 0: any token will do for them
            torch.index_select(feed, 0, ids, out=self.input_ids[:total])
        self.positions[:total].copy_(staged[total : 2 * total])
        self.slot_mapping[:total].copy_(staged[2 * total : 3 * total])
        self.seq_lens[:rung].copy_(staged[3 * total : 3 * total + rung])
        if self.lora is not None:
            self.lora_token_slots[:total].copy_(staged[lora_at : lora_at + total])
        if ssm_slots is not None:
            self.ssm_slots[:rung].copy_(staged[ssm_at : ssm_at + rung])
        if send_tables:
            self.block_tables[:rows, :width].copy_(staged[tables_at:].view(rows, width))
            if rung > rows:
                self.block_tables[rows:rung, :null_cols].zero_()
        self._last_key = (rung, query_len)
        if self.graphs:
            graph = self.graphs.get((rung, query_len))
            if graph is None:
                raise ValueError(f"no graph captured for batch {rung}, Q={query_len}")
            graph.replay()
            self.replays += 1
            return self.outputs[rung, query_len][:real]
        # Not captured (a CPU check of the buffer logic): run the same body eagerly.
        if query_len == 1:
            return self._body(rung)[:real]
        return self._body(rung, query_len)[:real]
