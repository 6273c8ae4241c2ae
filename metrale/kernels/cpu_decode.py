"""The CPU's fused decode step: every layer of a dense decoder (Llama / Mistral / Qwen2 /
Qwen3) for a batch of one-token rows in one C call (`metrale_decode_stack_f32` in
`csrc/cpu_gemv.c`), from the token embeddings to the final norm.

Owner: kernels. `TransformerModel` holds one (`cpu_decode`, built by the factory on the CPU)
and runs a forward through it when `takes` says so; everything else (prefill and mixed
steps, verify rows, LoRA, vision, MTP) keeps the layer-by-layer path.

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
- It runs only where it is that function: `build` checks the module's exact classes and
  settings once (else None, with the reason logged), `takes` checks the forward (plain decode
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
import logging
import os
from collections.abc import Sequence

import torch

from metrale.kernels import cpu_gemv
from metrale.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

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


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:  # pragma: no cover - not Linux
        return False


def why_not(
    module: torch.nn.Module, kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> str | None:
    """Why `module` cannot take the fused step (None: it can)."""
    from metrale.layers.common import GatedMLP, PagedSelfAttention
    from metrale.models.llama import DecoderLayer, DecoderStack, LlamaForCausalLM

    if type(module) is not LlamaForCausalLM or type(module.model) is not DecoderStack:
        return f"{type(module).__name__} is not the plain dense decoder"
    stack = module.model
    rotary = stack.rotary
    head_dim = module.config.head_dim
    if rotary.rotary_dim != head_dim or head_dim % 2:
        return "partial or odd-width rotary"
    if len(kv_layers) != len(stack.layers):
        return "the KV cache does not hold one pair per layer"
    eps = stack.norm.eps
    for layer, (k, v) in zip(stack.layers, kv_layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not DecoderLayer or type(attn) is not PagedSelfAttention:
            return "a layer of another kind"
        if type(mlp) is not GatedMLP or mlp.gate_up_proj.bias is not None:
            return "an MLP of another kind or with a bias"
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(type(p) is not torch.nn.Linear for p in projections):
            return "quantized or otherwise replaced projections"
        if mlp.down_proj.bias is not None or attn.o_proj.bias is not None:
            return "an output projection with a bias"
        if attn.sliding_window is not None:
            return "a sliding-window layer"
        if attn.rotary is not rotary:
            return "a layer with its own rotary table"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        if any(n.eps != eps for n in norms):
            return "norms with different epsilons"
        if k.dtype != torch.float32 or v.dtype != torch.float32:
            return "a KV cache that is not float32"
    if any(p.dtype != torch.float32 for p in module.parameters()):
        return "weights that are not float32"
    if module.config.num_attention_heads % module.config.num_key_value_heads:
        return "query heads not a multiple of the KV heads"
    return None


class CpuDecodeStack:
    """The fused decode step of one model (see the module docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        weights_bf16: bool = False,
    ) -> None:
        lib = ctypes.CDLL(str(cpu_gemv.build()))
        fn = lib.metrale_decode_stack_f32
        ptr, long, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        fn.argtypes = [ptr, long, long, long, ptr, ptr, ptr, f32, long, long, long, long, long,
                       ptr, ptr, ptr, ptr, long, ptr, f32, ptr, ctypes.c_int,
                       ctypes.c_int]  # fmt: skip
        fn.restype = None
        scratch = lib.metrale_decode_scratch
        scratch.argtypes = [long] * 7
        scratch.restype = long
        self._fn, self._scratch_floats, self._lib = fn, scratch, lib
        cfg = module.config
        stack = module.model
        self.module = module
        self.hidden = cfg.hidden_size
        self.q_heads, self.kv_heads, self.dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        )  # fmt: skip
        self.inter = stack.layers[0].mlp.down_proj.in_features
        self.eps = stack.norm.eps
        self.scale = stack.layers[0].self_attn.scale
        self.rotary = stack.rotary
        self.embed = stack.embed_tokens.weight
        self.final_norm = stack.norm.weight
        self.kv_layers = list(kv_layers)
        self.block_size = kv_layers[0][0].shape[1]
        weights: list[torch.Tensor | None] = []
        for layer in stack.layers:
            attn = layer.self_attn
            weights += [
                layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                attn.q_norm.weight if attn.qk_norm else None,
                attn.k_norm.weight if attn.qk_norm else None,
                attn.o_proj.weight, layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
            ]  # fmt: skip
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
        h = self.embed.index_select(0, input_ids)
        max_len = max(meta.seq_lens_host[:rows])
        need = self._scratch_floats(
            rows, self.hidden, self.q_heads, self.kv_heads, self.dim, self.inter, max_len
        )
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        self.rotary.ensure_positions(max_len)
        cos_sin = self.rotary.cos_sin
        positions = meta.positions[:rows].contiguous()
        slots = meta.slot_mapping[:rows].contiguous()
        seq_lens = meta.seq_lens[:rows].to(torch.int32).contiguous()
        tables = meta.block_tables[:rows].to(torch.int32).contiguous()
        kv = (ctypes.c_void_p * (2 * len(self.kv_layers)))(
            *(t.data_ptr() for pair in self.kv_layers for t in pair)
        )
        self._fn(
            h.data_ptr(), rows, self.hidden, len(self.kv_layers), self._weight_ptrs, kv,
            self.final_norm.data_ptr(), self.eps, self.q_heads, self.kv_heads, self.dim,
            self.inter, self.block_size, positions.data_ptr(), slots.data_ptr(),
            seq_lens.data_ptr(), tables.data_ptr(), tables.stride(0), cos_sin.data_ptr(),
            self.scale, self._scratch.data_ptr(), torch.get_num_threads(),
            int(self.weights_bf16),
        )  # fmt: skip
        self.fused_forwards += 1
        return h


def build(
    module: torch.nn.Module, kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> CpuDecodeStack | None:
    """The fused step for `module` on the CPU, or None (logged: the mode, why the model
    cannot take it, or why the kernel could not be built)."""
    bf16 = weights_mode() == "bf16"
    if mode() == "layers":
        logger.info("kernels: CPU decode layer by layer (METRALE_CPU_DECODE=layers)")
        if bf16:
            logger.warning("METRALE_CPU_WEIGHTS=bf16 has no effect: it is the fused step's")
        return None
    reason = why_not(module, kv_layers)
    if reason is None:
        try:
            stack = CpuDecodeStack(module, kv_layers, weights_bf16=bf16)
        except (cpu_gemv.GemvUnavailable, OSError, AttributeError, ValueError) as exc:
            reason = f"the kernel is unavailable: {exc}"
        else:
            logger.info(
                "kernels: CPU decode steps fused (every layer in one C call)%s",
                "; projections read bfloat16 copies of the weights (METRALE_CPU_WEIGHTS=bf16:"
                f" not exact; this CPU has avx512_bf16: {_cpu_has('avx512_bf16')}, unused:"
                " the widening is a shift)" if bf16 else "",
            )  # fmt: skip
            return stack
    logger.info("kernels: CPU decode layer by layer (the fused step does not apply: %s)", reason)
    return None
