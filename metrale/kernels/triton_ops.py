"""The CUDA op set: which `KernelOps` entries have a Triton kernel, and the factory that binds
them. `kernels_for(cuda)` imports this module only when triton is importable.

Owner: kernels.

Invariants:
- `TRITON_OPS` is the registry: op name -> (module, function) of the Triton implementation,
  each computing the same function as the `reference` entry of the same name and tested
  against it in `tests/gpu/test_kernels.py` (the LoRA ops in `tests/gpu/test_lora_kernels.py`
  and, `lora_linear`, `tests/gpu/test_lora_epilogue.py`; `row_topk` in
  `tests/gpu/test_sampler_kernels.py`;
  the FP8 projections in `tests/gpu/test_fp8_linear.py`, the recurrent-layer ops in
  `tests/gpu/test_ssm_kernels.py`, the MoE ops in `tests/gpu/test_moe_kernels.py`). An op not
  listed keeps its torch reference.
- The factory reports every op's implementation ("triton" | "torch") in
  `KernelOps.implementations`, so a slower path is never silent.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import fields

from metrale.kernels import KernelOps

#: op name -> (module, function). Add a line here when a Triton kernel for an op lands.
TRITON_OPS: dict[str, tuple[str, str]] = {
    "rms_norm": ("metrale.kernels.triton_norm", "rms_norm"),
    "add_rms_norm": ("metrale.kernels.triton_norm", "add_rms_norm"),
    "silu_and_mul": ("metrale.kernels.triton_norm", "silu_and_mul"),
    "linear": ("metrale.kernels.triton_linear", "linear"),
    "silu_mul_linear": ("metrale.kernels.triton_linear", "silu_mul_linear"),
    "linear_fp8": ("metrale.kernels.triton_fp8", "linear_fp8"),
    "silu_mul_linear_fp8": ("metrale.kernels.triton_fp8", "silu_mul_linear_fp8"),
    "write_kv": ("metrale.kernels.triton_attention", "write_kv"),
    "paged_attention": ("metrale.kernels.triton_attention", "paged_attention"),
    "rotary_embedding": ("metrale.kernels.triton_rotary", "rotary_embedding"),
    "qk_norm_rotary": ("metrale.kernels.triton_rotary", "qk_norm_rotary"),
    "rotary_write_kv": ("metrale.kernels.triton_rotary", "rotary_write_kv"),
    "qk_norm_rotary_write_kv": ("metrale.kernels.triton_rotary", "qk_norm_rotary_write_kv"),
    "argmax": ("metrale.kernels.triton_sampling", "argmax"),
    "greedy_logprobs": ("metrale.kernels.triton_sampling", "greedy_logprobs"),
    "top_k_top_p_sample": ("metrale.kernels.triton_top_k_top_p", "top_k_top_p_sample"),
    "token_logprobs": ("metrale.kernels.triton_sampling", "token_logprobs"),
    "masked_argmax": ("metrale.kernels.triton_sampling", "masked_argmax"),
    "apply_token_bitmask": ("metrale.kernels.triton_sampling", "apply_token_bitmask"),
    "candidate_sample": ("metrale.kernels.triton_candidates", "candidate_sample"),
    "row_topk": ("metrale.kernels.triton_row_topk", "row_topk"),
    "lora_gather_add": ("metrale.kernels.triton_lora", "lora_gather_add"),
    "lora_tiles_add": ("metrale.kernels.triton_lora_tiles", "lora_tiles_add"),
    "lora_plan": ("metrale.kernels.triton_lora_tiles", "lora_plan"),
    "lora_linear": ("metrale.kernels.triton_linear", "lora_linear"),
    "causal_conv1d_update": ("metrale.kernels.triton_ssm", "causal_conv1d_update"),
    "mamba2_state_update": ("metrale.kernels.triton_ssm", "mamba2_state_update"),
    "gated_delta_update": ("metrale.kernels.triton_ssm", "gated_delta_update"),
    "causal_conv1d_varlen": ("metrale.kernels.triton_ssm_prefill", "causal_conv1d_varlen"),
    "mamba2_chunk_scan_varlen": ("metrale.kernels.triton_ssm_prefill", "mamba2_chunk_scan_varlen"),
    "gated_delta_chunk_varlen": ("metrale.kernels.triton_ssm_prefill", "gated_delta_chunk_varlen"),
    "moe_softmax_topk": ("metrale.kernels.triton_moe_routing", "moe_softmax_topk"),
    "moe_experts": ("metrale.kernels.triton_moe", "moe_experts"),
    "moe_softmax_experts": ("metrale.kernels.triton_moe", "moe_softmax_experts"),
}


#: Ops of the decode path whose Triton kernels take `pdl=True` (programmatic dependent launch:
#: each waits for the previous kernel on entry, so it may be launched while that one drains).
PDL_OPS = frozenset(
    {"rms_norm", "add_rms_norm", "linear", "silu_mul_linear", "linear_fp8",
     "silu_mul_linear_fp8", "paged_attention", "rotary_write_kv", "qk_norm_rotary_write_kv",
     "lora_gather_add", "lora_tiles_add", "lora_linear", "moe_softmax_topk", "moe_experts", "moe_softmax_experts"}
)  # fmt: skip


def triton_kernel_ops(pdl: bool = False) -> KernelOps:
    """`KernelOps` with every registered Triton kernel bound, references elsewhere; with
    `pdl`, the `PDL_OPS` launch as programmatic dependents (reported as "triton+pdl")."""
    names = {f.name for f in fields(KernelOps)} - {"implementations", "counters"}
    chosen = {}
    for name, (module, function) in TRITON_OPS.items():
        if name in names:
            fn = getattr(importlib.import_module(module), function)
            chosen[name] = functools.partial(fn, pdl=True) if pdl and name in PDL_OPS else fn
    implementations = {
        name: ("triton+pdl" if pdl and name in PDL_OPS else "triton") if name in chosen else "torch"
        for name in sorted(names)
    }
    return KernelOps(**chosen, implementations=implementations)
