"""Hot ops chosen by device: the torch references on the CPU (projections by our few-row C GEMV
and oneDNN, `cpu_linear`; norms, rotary + KV write and decode attention in `cpu_ops`' lean forms), Triton kernels on CUDA where a kernel exists and pays.

Owner: kernels. Layers receive a `KernelOps` at construction and call through it; nothing
here is global or mutable after selection.

Invariants:
- Every op in a `KernelOps` computes the same function as its torch reference (`reference`,
  `ssm_reference`, `lora_reference`); each Triton kernel has a test against that reference.
- `kernels_for` logs which implementation each op got, so a slower path is never silent.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from metrale.errors import InvalidRequestError
from metrale.kernels import lora_reference, reference, ssm_reference

logger = logging.getLogger(__name__)


def _no_counters() -> dict[str, int]:
    return {}


@dataclass(frozen=True)
class KernelOps:
    rms_norm: Callable = reference.rms_norm
    add_rms_norm: Callable = reference.add_rms_norm
    silu_and_mul: Callable = reference.silu_and_mul
    # Projections: cuBLAS through torch, except few-row (decode) batches on CUDA, where a
    # bandwidth-bound GEMV kernel reads the weights faster.
    linear: Callable = reference.linear
    silu_mul_linear: Callable = reference.silu_mul_linear
    # FP8 (E4M3) weight projections, `(x, weight, scale, bias, block)`: W8A16 kernels on CUDA
    # (`triton_fp8`); the reference dequantizes and calls F.linear (the CPU keeps FP8
    # checkpoints dequantized at load, so it only runs in tests).
    linear_fp8: Callable = reference.linear_fp8
    silu_mul_linear_fp8: Callable = reference.silu_mul_linear_fp8
    # `(rows, weights)`: hint the weights a decode forward of `rows` rows reads next into the
    # GPU's L2 (`triton_prefetch`). None: nothing to do (the CPU; CUDA unless enabled).
    prefetch_l2: Callable | None = None
    write_kv: Callable = reference.write_kv
    paged_attention: Callable = reference.paged_attention
    # Rotary embedding, alone or fused with Qwen3's per-head q/k RMSNorm; the `_write_kv`
    # forms also store the rotated k and v in the KV cache (the attention layer's path).
    rotary_embedding: Callable = reference.rotary_embedding
    qk_norm_rotary: Callable = reference.qk_norm_rotary
    rotary_write_kv: Callable = reference.rotary_write_kv
    qk_norm_rotary_write_kv: Callable = reference.qk_norm_rotary_write_kv
    # The sampler's hot path (device argmax; top-k/min-p/top-p draw without a full sort).
    argmax: Callable = reference.argmax
    # Greedy rows of unprocessed logits: token, raw logprob, rank and samplable in one pass.
    greedy_logprobs: Callable = reference.greedy_logprobs
    # Greedy rows whose only processing is banned ids (min_tokens' stop ids), `(logits,
    # banned ids per row)`: the torch path's result (`reference.stop_masked_greedy`) in one
    # pass but its logsumexp. None: the sampler's torch path (the C kernel is the CPU's only).
    stop_masked_greedy: Callable | None = None
    top_k_top_p_sample: Callable = reference.top_k_top_p_sample
    # The sampler's candidate draw: the draw on each row's top-k candidates, then the drawn
    # token's raw logprob and rank in one pass.
    candidate_sample: Callable = reference.candidate_sample
    # A row's `width` largest logits, sorted (the candidate draw's cut; `torch.topk` on the CPU).
    row_topk: Callable = reference.row_topk
    token_logprobs: Callable = reference.token_logprobs
    # Structured output: the greedy draw under a grammar's token bitmask (no masked logits
    # built), and the bitmask applied to processed logits (the sampled rows).
    masked_argmax: Callable = reference.masked_argmax
    apply_token_bitmask: Callable = reference.apply_token_bitmask
    # Recurrent layers and MoE (hybrid and MoE models); see `ssm_reference`.
    causal_conv1d_varlen: Callable = ssm_reference.causal_conv1d_varlen
    causal_conv1d_update: Callable = ssm_reference.causal_conv1d_update
    mamba2_chunk_scan_varlen: Callable = ssm_reference.mamba2_chunk_scan_varlen
    mamba2_state_update: Callable = ssm_reference.mamba2_state_update
    gated_delta_chunk_varlen: Callable = ssm_reference.gated_delta_chunk_varlen
    gated_delta_update: Callable = ssm_reference.gated_delta_update
    moe_softmax_topk: Callable = ssm_reference.moe_softmax_topk
    moe_experts: Callable = ssm_reference.moe_experts
    moe_softmax_experts: Callable = ssm_reference.moe_softmax_experts
    # Multi-LoRA by per-row slot gather (the capturable form; see `metrale.layers.lora`).
    lora_gather_add: Callable = lora_reference.lora_gather_add
    lora_tiles_add: Callable = lora_reference.lora_tiles_add
    lora_plan: Callable = lora_reference.lora_plan
    # A base projection plus one LoRA group's deltas (few rows on CUDA: the expand folded
    # into the GEMV's stores, `triton_lora_epilogue`).
    lora_linear: Callable = lora_reference.lora_linear
    #: The ops' own counters (`{name: count}`, merged into the model's forward counters): the
    #: CPU projections' calls by path (`cpu_linear.CpuLinear.counters`); empty elsewhere.
    counters: Callable[[], dict[str, int]] = _no_counters
    #: op name -> "torch" | "triton" | "triton+pdl", for logs, metrics and benchmark records.
    implementations: dict[str, str] = field(default_factory=dict)


def _l2_prefetch_choice(ops: KernelOps, pdl: bool) -> KernelOps:
    """`ops` with the experimental L2 prefetch of the next projections' weights during the
    attention of a decode step (`triton_prefetch`) when METRALE_L2_PREFETCH=1 (logged); else
    reported "off" (the layers skip the hint)."""
    if os.environ.get("METRALE_L2_PREFETCH", "0") != "1":
        return replace(ops, implementations={**ops.implementations, "prefetch_l2": "off"})
    from metrale.kernels import triton_prefetch

    logger.info("L2 prefetch of the o_proj and MLP weights during decode attention "
                "(METRALE_L2_PREFETCH=1, experimental)")  # fmt: skip
    impls = {**ops.implementations, "prefetch_l2": "triton+pdl" if pdl else "triton"}
    fn = functools.partial(triton_prefetch.prefetch_l2, pdl=pdl)
    return replace(ops, prefetch_l2=fn, implementations=impls)


def kernels_for(
    device: torch.device,
    use_triton: bool = True,
    pdl: bool | None = None,
    batch_invariant: bool = False,
) -> KernelOps:
    """The op set for a device. CUDA gets Triton kernels when they are importable. `pdl`:
    launch the decode-path kernels as programmatic dependents; None: on where supported
    (sm_90+), unless the environment sets `METRALE_PDL=0`. `batch_invariant` (CPU only):
    the projections and attention of `metrale.kernels.invariant`, whose rows never depend
    on the rest of the batch."""
    if batch_invariant:
        if device.type != "cpu":
            raise InvalidRequestError(
                "batch_invariant: the batch-invariant kernels are built for the CPU only",
                param="batch_invariant",
            )
        from metrale.kernels import invariant

        names = [f.name for f in fields(KernelOps) if f.name not in ("implementations", "counters")]
        impls = dict.fromkeys(names, "torch")
        impls.update(linear="invariant", silu_mul_linear="invariant", paged_attention="invariant")
        logger.info("kernels: batch-invariant projections and attention (CPU)")
        return KernelOps(
            linear=invariant.linear,
            silu_mul_linear=invariant.silu_mul_linear,
            paged_attention=invariant.paged_attention,
            implementations=impls,
        )
    if device.type == "cuda" and use_triton:
        try:
            from metrale.kernels.triton_attention_common import pdl_supported
            from metrale.kernels.triton_ops import triton_kernel_ops
        except ImportError as exc:  # pragma: no cover - depends on the machine
            logger.warning("Triton kernels unavailable (%s); using torch reference ops", exc)
        else:
            if pdl is None:
                pdl = pdl_supported(device) and os.environ.get("METRALE_PDL", "1") != "0"
                if not pdl:
                    logger.info("programmatic dependent launch off (unsupported or METRALE_PDL=0)")
            ops = _l2_prefetch_choice(triton_kernel_ops(pdl=pdl), pdl)
            logger.info("kernels: %s", ops.implementations)
            return ops
    names = [f.name for f in fields(KernelOps) if f.name not in ("implementations", "counters")]
    impls = dict.fromkeys(names, "torch")
    if device.type == "cpu":
        from metrale.kernels import cpu_linear

        lean: dict[str, Callable] = {}
        projections = cpu_linear.make(cpu_linear.mode_from_env())
        if projections is not None:
            impls.update(linear=projections.name, silu_mul_linear=projections.name)
            lean["linear"] = projections.linear
            lean["silu_mul_linear"] = projections.silu_mul_linear
            lean["counters"] = projections.counters
        if os.environ.get("METRALE_CPU_OPS", "lean") == "torch":
            logger.info("kernels: CPU norms, rotary, decode attention and greedy sampling by "
                        "the references (METRALE_CPU_OPS=torch)")  # fmt: skip
        else:
            from metrale.kernels import cpu_ops

            lean_ops = cpu_ops.CpuOps()
            lean.update({name: getattr(lean_ops, name) for name in cpu_ops.LEAN_OPS})
            impls.update(dict.fromkeys(cpu_ops.LEAN_OPS, "cpu-lean"))
            logger.info("kernels: CPU norms, rotary + KV write, decode attention and greedy "
                        "sampling, lean forms (float32; others the references)")  # fmt: skip
        return KernelOps(**lean, implementations=impls)
    return KernelOps(implementations=impls)
