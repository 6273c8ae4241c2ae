"""The CPU's fused decode step: every layer of a dense decoder (Llama / Mistral / Qwen2 /
Qwen3) for a batch of one-token rows in one C call (`metrale_decode_stack_f32` in
`csrc/cpu_gemv.c`), from the token embeddings to the final norm.

Owner: kernels (the call and its arithmetic). `model_engine/cpu_fused_decode.py` decides which
models take it and gathers their weights (`DecoderWeights`); `TransformerModel` holds one
(`cpu_decode`, built by the factory on the CPU) and runs a forward through it when `takes`
says so, or, for a forward of one-token decode rows it takes whole, straight from the rows'
host lists (`decode_rows`: the same arguments, no metadata tensors built); everything else (prefill and mixed steps, verify rows, LoRA, vision, MTP) keeps the
layer-by-layer path.

Why (issue 26): a small model's CPU decode step is bound by torch's per-call cost (~30 calls
and module dispatches a layer: the tiny model's 0.44 ms forward of 0.60 ms a step), not by
arithmetic; the C step makes the same computation with one call.

Invariants:
- The same function as the layer-by-layer path, in float32: RMSNorm (sum of squares / n + eps,
  reciprocal square root, times the weight), the fused QKV projection (+ bias), per-head q/k
  RMSNorm when the model has it, the rotate-half rotary from the model's own table over the
  whole head, the new key and value written to the paged cache before attention, exact
  softmax attention over each row's cached positions (GQA), o projection, residual, RMSNorm,
  SiLU-gated MLP, residual, final RMSNorm. Only float32 summation orders differ (~1e-6
  relative): the parity tests hold it to transformers' greedy tokens.
- It runs only where it is that function: the model side checks the module's exact classes
  and settings once (else no step, with the reason logged), `takes` checks the forward (plain decode
  rows, every block resident). Which path a forward takes depends on the batch (a step with
  a prompt chunk runs layer by layer), so, like the projections' row-count paths, it moves
  logprobs by float32 rounding only; `EngineConfig.batch_invariant` (results independent of
  the batch) keeps the layer-by-layer invariant ops and never builds it.
- `METRALE_CPU_DECODE=layers` keeps the layer-by-layer path (the reference); the default is
  `fused`. Forwards through it are counted (`fused_forwards`).
- `METRALE_CPU_WEIGHTS=bf16` (opt-in, not exact): the fused step's four projections a layer
  read bfloat16 copies of their weights (half the bytes of a memory-bound step), widened to
  float32 exactly in the kernel, with float32 activations and sums; prefill and the layer
  path keep the float32 weights. Its agreement with float32 is measured, not assumed
  (`tests/models/test_cpu_fused_decode.py`, the CPU ladder's record).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from metrale.kernels import cpu_gemv
from metrale.kernels.metadata import AttentionMetadata

#: Most rows a fused step takes: its projections are the few-row C GEMV, which re-reads
#: each weight row for every four rows; from 16 rows the layer path's oneDNN GEMM was faster
#: (CPU ladder at C=16: tiny 4,071 against 5,146 tok/s, small 434 against 656, and tiny's
#: TTFT p90 went past 3x its p50), so more rows keep the layer path.
MAX_ROWS = cpu_gemv.MAX_ROWS

#: `METRALE_CPU_DECODE` values.
MODES = ("fused", "layers")
#: `METRALE_CPU_WEIGHTS` values: what the fused step's projections read.
WEIGHT_MODES = ("float32", "bf16")


def mode() -> str:
    """`METRALE_CPU_DECODE` (default `fused`); an unknown value is an error naming it."""
    value = os.environ.get("METRALE_CPU_DECODE", "fused")
    if value not in MODES:
        raise ValueError(f"METRALE_CPU_DECODE={value!r}: expected one of {', '.join(MODES)}")
    return value


def weights_mode() -> str:
    """`METRALE_CPU_WEIGHTS` (default `float32`); an unknown value is an error naming it."""
    value = os.environ.get("METRALE_CPU_WEIGHTS", "float32")
    if value not in WEIGHT_MODES:
        raise ValueError(
            f"METRALE_CPU_WEIGHTS={value!r}: expected one of {', '.join(WEIGHT_MODES)}"
        )
    return value


def cpu_has(flag: str) -> bool:
    """Whether the CPU's flags (`cpu_gemv.cpu_flags`) list `flag`."""
    return flag in cpu_gemv.cpu_flags().split()


@dataclass
class DecoderWeights:
    """What the fused step reads of a dense decoder, gathered by the model side
    (`model_engine/cpu_fused_decode.py`): per layer, in order, the input norm, the fused QKV
    weight and bias (or None), the q and k norms (or None), the o weight, the post-attention
    norm, the fused gate/up weight `[2 * inter, hidden]` and the down weight; every tensor
    contiguous float32."""

    layers: list[list[torch.Tensor | None]]
    embed: torch.Tensor
    final_norm: torch.Tensor
    #: The rotary table's owner: `cos_sin` `[positions, 2, head_dim / 2]` and
    #: `ensure_positions(n)` (the model's `RotaryEmbedding`).
    rotary: Any
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float


class CpuDecodeStack:
    """The fused decode step of one model (see the module docstring)."""

    def __init__(
        self,
        model: DecoderWeights,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        weights_bf16: bool = False,
    ) -> None:
        ptr, long, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        path = cpu_gemv.build()
        self._fn = cpu_gemv.kernel_function(
            path, "metrale_decode_stack_f32",
            [ptr, long, long, long, ptr, ptr, ptr, f32, long, long, long, long, long, ptr, ptr,
             ptr, ptr, long, ptr, f32, ptr, ctypes.c_int, ctypes.c_int],
        )  # fmt: skip
        self._scratch_floats = cpu_gemv.kernel_function(
            path, "metrale_decode_scratch", [long] * 7, long
        )
        self.hidden, self.q_heads, self.kv_heads = model.hidden, model.q_heads, model.kv_heads
        self.dim, self.inter, self.eps, self.scale = (
            model.head_dim, model.inter, model.eps, model.scale
        )  # fmt: skip
        self.rotary = model.rotary
        self.embed = model.embed
        self.final_norm = model.final_norm
        self.kv_layers = list(kv_layers)
        self.block_size = kv_layers[0][0].shape[1]
        if any(len(layer) != 9 for layer in model.layers) or len(model.layers) != len(kv_layers):
            raise ValueError("the fused CPU decode step needs 9 tensors a layer, one KV pair each")
        weights = [t for layer in model.layers for t in layer]
        for t in weights:
            if t is not None and not t.is_contiguous():
                raise ValueError("the fused CPU decode step needs contiguous weights")
        #: The projections read bfloat16 copies (half the bytes; not exact: opt-in).
        self.weights_bf16 = weights_bf16
        if weights_bf16:  # the four projections of each layer: entries 1, 5, 7, 8 of 9
            weights = [
                t.to(torch.bfloat16).contiguous() if t is not None and i % 9 in (1, 5, 7, 8)
                else t
                for i, t in enumerate(weights)
            ]  # fmt: skip
        self._weights = weights  # kept alive: the pointer table refers to them
        self._weight_ptrs = (ptr * len(weights))(
            *(t.data_ptr() if t is not None else None for t in weights)
        )
        self._scratch = torch.empty(0, dtype=torch.float32)
        #: Forwards run by the fused step.
        self.fused_forwards = 0

    def takes(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether a forward of `rows` rows with this metadata is plain one-token decode of
        resident blocks (what the fused step computes), of at most `MAX_ROWS` rows."""
        return (
            0 < rows <= MAX_ROWS
            and meta.num_decode == rows
            and meta.num_seqs == rows
            and meta.decode_query_len == 1
            and meta.max_query_len == 1
            and meta.host_kv is None
            and meta.ssm_slots is None
            and bool(meta.seq_lens_host)
        )

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden state after the final norm, `[rows, hidden]`, for one-token rows."""
        rows = input_ids.shape[0]
        positions = meta.positions[:rows].contiguous()  # the copies live through the call
        slots = meta.slot_mapping[:rows].contiguous()
        seq_lens = meta.seq_lens[:rows].to(torch.int32).contiguous()
        tables = meta.block_tables[:rows].to(torch.int32).contiguous()
        return self._run(
            input_ids, max(meta.seq_lens_host[:rows]), positions.data_ptr(), slots.data_ptr(),
            seq_lens.data_ptr(), tables.data_ptr(), tables.stride(0),
        )  # fmt: skip

    def decode_rows(
        self, input_ids: torch.Tensor, positions: list[int], tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """`__call__` from the host lists of one-token decode rows (row `i` at position
        `positions[i]`, its blocks `tables[i]`, every one resident), without building their
        `AttentionMetadata`: the same arguments reach the C step, as ctypes arrays (the
        metadata's seven tensors and their int32 copies cost more than a tiny model's layers,
        issue 26)."""
        rows, block = len(positions), self.block_size
        width = max(len(t) for t in tables)
        flat: list[int] = []
        for t in tables:
            flat += t
            if len(t) < width:
                flat += [0] * (width - len(t))
        slots = [t[p // block] * block + p % block for t, p in zip(tables, positions)]
        lens = [p + 1 for p in positions]
        return self._run(
            input_ids, max(lens), (ctypes.c_long * rows)(*positions),
            (ctypes.c_long * rows)(*slots), (ctypes.c_int * rows)(*lens),
            (ctypes.c_int * len(flat))(*flat), width,
        )  # fmt: skip

    def _run(
        self,
        input_ids: torch.Tensor,
        max_len: int,
        positions: Any,
        slots: Any,
        seq_lens: Any,
        tables: Any,
        table_stride: int,
    ) -> torch.Tensor:
        """The C step over rows `input_ids`; the others are pointers (or ctypes arrays) to
        int64 positions and slots, int32 lengths and block tables (rows `table_stride` apart)."""
        rows = input_ids.shape[0]
        h = self.embed.index_select(0, input_ids)
        need = self._scratch_floats(
            rows, self.hidden, self.q_heads, self.kv_heads, self.dim, self.inter, max_len
        )
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        self.rotary.ensure_positions(max_len)
        cos_sin = self.rotary.cos_sin
        kv = (ctypes.c_void_p * (2 * len(self.kv_layers)))(
            *(t.data_ptr() for pair in self.kv_layers for t in pair)
        )
        self._fn(
            h.data_ptr(), rows, self.hidden, len(self.kv_layers), self._weight_ptrs, kv,
            self.final_norm.data_ptr(), self.eps, self.q_heads, self.kv_heads, self.dim,
            self.inter, self.block_size, positions, slots, seq_lens, tables, table_stride,
            cos_sin.data_ptr(), self.scale, self._scratch.data_ptr(), torch.get_num_threads(),
            int(self.weights_bf16),
        )  # fmt: skip
        self.fused_forwards += 1
        return h
