"""The encoder-decoder's decoder step as a static body over persistent buffers, captured as
CUDA graphs over a batch ladder: `EncDecStepGraphs`.

Owner: model-engine (`EncoderDecoderModel.enable_step_graphs` builds it; `decode_batch`
routes a forward here when `fits`).

The body is the decoder stack of `M2M100ForConditionalGeneration.run_decoder` with static
attentions (`_StaticAttention`): self-attention writes K/V at the rows' slots and attends
every block of a fixed-width block table masked by the rows' lengths; cross-attention reads
the row's source from a pool of request slots (`[slots, heads, source_cap, dim]` per layer,
filled once per request by `attach`) masked by that slot's valid keys. Every shape depends
only on the rung, so one graph per rung of `DECODE_BATCH_LADDER` (and 1) up to `max_rows`
replays any step that fits. On the CPU nothing is captured: `run` executes the same body
eagerly (how the CPU tests check it).

Invariants:
- Inputs reach the body only through one flat int64 buffer, written by one host-to-device
  copy per step (from pinned memory on CUDA); the layout for rung R is `[ids | positions | slots | lengths | source
  slots | block tables (R x max_blocks)]`.
- Rows past the real batch are padding: token 0 at the first decoder position, writing slot
  0 of the null block (block 0, which may hold garbage), length 1, reading the dummy source
  slot (one valid key of zeros); their logits rows are never read.
- A request's source occupies a pool slot from `attach` until `detach` (its last sequence
  freed); a source longer than `source_cap`, or a full pool, gets no slot, and forwards that
  include it run eagerly (counted in `eager_forwards`, the reason logged once).
- The returned logits are the graph's static output: valid until the next `run`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from metrale.cache.block_pool import blocks_for
from metrale.model_engine.cuda_graphs import CAPTURE_MODE
from metrale.model_engine.sequence import DECODE_BATCH_LADDER
from metrale.model_engine.traits import SequenceState

if TYPE_CHECKING:
    from metrale.models.m2m100 import CrossKv, M2M100ForConditionalGeneration

logger = logging.getLogger(__name__)


class _StaticAttention:
    """The body's attentions over views of the persistent buffers for one rung."""

    def __init__(
        self,
        graphs: EncDecStepGraphs,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        sources: torch.Tensor,
        tables: torch.Tensor,
    ) -> None:
        self.g = graphs
        self.slots, self.sources, self.tables = slots, sources, tables
        width = tables.shape[1] * graphs.block_size
        self.key_mask = (graphs.key_positions[:width][None, :] < lengths[:, None])[:, None, None]
        self.source_mask = graphs.pool_valid.index_select(0, sources)[:, None, None, :]

    def self_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
    ) -> torch.Tensor:
        kc, vc = self.g.kv_layers[layer]
        heads, dim = kc.shape[2], kc.shape[3]
        kc.view(-1, heads, dim).index_copy_(0, self.slots, k.to(kc.dtype))
        vc.view(-1, heads, dim).index_copy_(0, self.slots, v.to(vc.dtype))
        rows = q.shape[0]
        keys = kc[self.tables].reshape(rows, -1, heads, dim).transpose(1, 2).to(q.dtype)
        values = vc[self.tables].reshape(rows, -1, heads, dim).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=self.key_mask, scale=scale
        )
        return o.squeeze(2)

    def cross_attend(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        pk, pv = self.g.pool[layer]
        keys = pk.index_select(0, self.sources)
        values = pv.index_select(0, self.sources)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=self.source_mask, scale=scale
        )
        return o.squeeze(2)


class EncDecStepGraphs:
    def __init__(
        self,
        module: M2M100ForConditionalGeneration,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        max_rows: int = 128,
        max_sources: int = 64,
        source_cap: int = 128,
    ) -> None:
        cfg = module.config
        self.module = module
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.device = device
        self.max_blocks = blocks_for(max_model_len, block_size)
        self.max_model_len = max_model_len
        self.source_cap = source_cap
        self.rungs = sorted({1, *(r for r in DECODE_BATCH_LADDER if r <= max_rows)} | {max_rows})
        self.max_rows = self.rungs[-1]
        heads, dim = cfg.decoder_attention_heads, cfg.head_dim
        self.dummy_slot = max_sources  # one valid key of zeros, read by padding rows
        shape = (max_sources + 1, heads, source_cap, dim)
        self.pool = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.decoder_layers)
        ]  # fmt: skip
        self.pool_valid = torch.zeros(max_sources + 1, source_cap, dtype=torch.bool, device=device)
        self.pool_valid[self.dummy_slot, 0] = True
        self._free_slots = list(range(max_sources - 1, -1, -1))
        self.key_positions = torch.arange(self.max_blocks * block_size, device=device)
        self.width = 5 + self.max_blocks
        self.flat = torch.zeros(self.max_rows * self.width, dtype=torch.int64, device=device)
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pad = cfg.pad_token_id
        #: Forwards replayed (or, on the CPU, run through the static body) / run eagerly.
        self.replays = 0
        self.eager_forwards = 0
        self._logged: set[str] = set()
        self.capture_seconds = 0.0

    @property
    def captured_rungs(self) -> list[int]:
        """The rungs with a captured graph (none on the CPU)."""
        return sorted(self._graphs)

    # ---------------------------------------------------------------- the body

    def _views(self, rows: int) -> tuple[torch.Tensor, ...]:
        flat = self.flat[: rows * self.width]
        ids, pos, slots, lens, sources = (flat[i * rows : (i + 1) * rows] for i in range(5))
        tables = flat[5 * rows :].view(rows, self.max_blocks)
        return ids, pos, slots, lens, sources, tables

    @torch.inference_mode()
    def _body(self, rows: int) -> torch.Tensor:
        ids, pos, slots, lens, sources, tables = self._views(rows)
        x = self.module.embed_decoder(ids, pos)
        attn = _StaticAttention(self, slots, lens, sources, tables)
        return self.module.compute_logits(self.module.run_decoder(x, attn))

    def capture(self) -> None:
        """Capture one graph per rung (CUDA; on the CPU nothing to capture)."""
        if self.device.type != "cuda":
            logger.info("encoder-decoder step: no CUDA, the static step body runs eagerly")
            return
        start = time.perf_counter()
        self._write_padding(self.max_rows)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for rows in self.rungs:  # warm-up (cuBLAS handles, SDPA kernel choice)
                self._body(rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.rungs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_MODE):
                self._outputs[rows] = self._body(rows)
            self._graphs[rows] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "encoder-decoder step graphs: rungs %s captured in %.1f s (source slots %d of %d "
            "tokens)",
            self.rungs,
            self.capture_seconds,
            self.dummy_slot,
            self.source_cap,
        )

    def _write_padding(self, rows: int) -> None:
        host = torch.zeros(rows * self.width, dtype=torch.int64)
        host[rows : 2 * rows] = self.pad + 1
        host[3 * rows : 4 * rows] = 1
        host[4 * rows : 5 * rows] = self.dummy_slot
        self.flat[: rows * self.width].copy_(host)

    # ---------------------------------------------------------------- sources

    def attach(self, cross: CrossKv) -> None:
        """Give `cross` a pool slot and copy its K/V there (no slot: its forwards run eagerly)."""
        n = cross.source_len
        if n > self.source_cap or not self._free_slots:
            reason = (
                f"a source of {n} tokens is over the graphs' {self.source_cap}"
                if n > self.source_cap
                else f"all {self.dummy_slot} source slots are in use"
            )
            if reason not in self._logged:
                self._logged.add(reason)
                logger.warning("encoder-decoder step graphs: %s; such steps run eagerly", reason)
            return
        slot = self._free_slots.pop()
        for (pk, pv), (ck, cv) in zip(self.pool, cross.layers, strict=True):
            pk[slot, :, :n].copy_(ck)
            pv[slot, :, :n].copy_(cv)
        valid = self.pool_valid[slot]
        valid.zero_()
        valid[:n] = True
        if cross.pad_mask is not None:
            valid[:n].masked_fill_(cross.pad_mask, False)
        cross.pool_slot = slot

    def detach(self, cross: CrossKv) -> None:
        if cross.pool_slot is not None:
            self._free_slots.append(cross.pool_slot)
            cross.pool_slot = None

    # ---------------------------------------------------------------- steps

    def fits(self, seqs: list[SequenceState]) -> bool:
        if len(seqs) > self.max_rows:
            return self._eager("the batch is over the largest rung")
        if None in [s.layer_states[0].pool_slot for s in seqs]:
            return self._eager("a row's source has no pool slot")
        if max([len(s.block_table) for s in seqs]) > self.max_blocks:
            return self._eager("a row's block table is wider than the graphs'")
        return True

    def _eager(self, reason: str) -> bool:
        self.eager_forwards += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("encoder-decoder step graphs: %s; the step runs eagerly", reason)
        return False

    def run(self, tokens: list[int], seqs: list[SequenceState]) -> torch.Tensor:
        """Logits `[len(seqs), vocab]` of one decoder token per sequence. The caller has
        allocated the blocks the rows write (and checked `fits`); `seq.seq_len` is the
        index of the row's token."""
        n = len(seqs)
        rows = next(r for r in self.rungs if r >= n)
        bs, pad, width = self.block_size, self.pad, self.max_blocks
        # Python lists, one comprehension per section: at 128 rows as fast as numpy sections
        # (measured, tools/profile_beam_host.py), at a few rows several times faster.
        ids = [*tokens, *([0] * (rows - n))]
        pos = [pad if t == pad else pad + 1 + s.seq_len for t, s in zip(tokens, seqs)]
        pos += [pad + 1] * (rows - n)
        slots = [s.block_table[s.seq_len // bs] * bs + s.seq_len % bs for s in seqs]
        slots += [0] * (rows - n)
        lens = [s.seq_len + 1 for s in seqs] + [1] * (rows - n)
        sources = [s.layer_states[0].pool_slot for s in seqs] + [self.dummy_slot] * (rows - n)
        tables: list[int] = []
        for s in seqs:
            tables += s.block_table
            tables += [0] * (width - len(s.block_table))
        tables += [0] * (width * (rows - n))
        staged = torch.tensor([*ids, *pos, *slots, *lens, *sources, *tables], dtype=torch.int64)
        if self.device.type == "cuda":  # pinned: the copy is truly asynchronous
            staged = staged.pin_memory()
        self.flat[: rows * self.width].copy_(staged, non_blocking=True)
        self.replays += 1
        graph = self._graphs.get(rows)
        if graph is None:
            return self._body(rows)[:n]
        graph.replay()
        return self._outputs[rows][:n]
