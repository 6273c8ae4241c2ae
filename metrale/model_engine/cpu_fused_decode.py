"""Which models take the CPU's fused decode step, and the step built for one.

Owner: model_engine. The step itself (the C call, its arithmetic, `takes`) is
`metrale.kernels.cpu_decode`'s; this module reads a loaded module: `why_not` checks its exact
classes and settings, `build` gathers its weights into `cpu_decode.DecoderWeights` and makes
the step, or says (logged once) why the model runs layer by layer.

Invariants:
- Only the plain dense decoder (`LlamaForCausalLM` over `DecoderStack`, no subclass) with
  plain `nn.Linear` projections, no output or MLP biases, no sliding window, one shared
  rotary table over the whole head, equal norm epsilons, float32 weights and KV: exactly the
  function the C step computes. Anything else returns None, never a partial step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from metrale.kernels import cpu_decode, cpu_gemv
from metrale.kernels.cpu_decode import CpuDecodeStack, DecoderWeights
from metrale.layers.common import GatedMLP, PagedSelfAttention
from metrale.models.llama import DecoderLayer, DecoderStack, LlamaForCausalLM

logger = logging.getLogger(__name__)

KvLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]


def why_not(module: torch.nn.Module, kv_layers: KvLayers) -> str | None:
    """Why `module` cannot take the fused step (None: it can)."""
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


def decoder_weights(module: torch.nn.Module) -> DecoderWeights:
    """What the fused step reads of a module `why_not` accepted."""
    cfg = module.config
    stack = module.model
    layers: list[list[torch.Tensor | None]] = []
    for layer in stack.layers:
        attn = layer.self_attn
        layers.append([
            layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
            attn.q_norm.weight if attn.qk_norm else None,
            attn.k_norm.weight if attn.qk_norm else None,
            attn.o_proj.weight, layer.post_attention_layernorm.weight,
            layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
        ])  # fmt: skip
    return DecoderWeights(
        layers=layers, embed=stack.embed_tokens.weight, final_norm=stack.norm.weight,
        rotary=stack.rotary, hidden=cfg.hidden_size, q_heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        inter=stack.layers[0].mlp.down_proj.in_features, eps=stack.norm.eps,
        scale=stack.layers[0].self_attn.scale,
    )  # fmt: skip


def build(module: torch.nn.Module, kv_layers: KvLayers) -> CpuDecodeStack | None:
    """The fused step for `module` on the CPU, or None (logged: the mode, why the model
    cannot take it, or why the kernel could not be built)."""
    bf16 = cpu_decode.weights_mode() == "bf16"
    if cpu_decode.mode() == "layers":
        logger.info("kernels: CPU decode layer by layer (METRALE_CPU_DECODE=layers)")
        if bf16:
            logger.warning("METRALE_CPU_WEIGHTS=bf16 has no effect: it is the fused step's")
        return None
    reason = why_not(module, kv_layers)
    if reason is None:
        try:
            stack = CpuDecodeStack(decoder_weights(module), kv_layers, weights_bf16=bf16)
        except (cpu_gemv.GemvUnavailable, ValueError) as exc:
            reason = f"the kernel is unavailable: {exc}"
        else:
            logger.info(
                "kernels: CPU decode steps fused (every layer in one C call)%s",
                "; projections read bfloat16 copies of the weights (METRALE_CPU_WEIGHTS=bf16:"
                f" not exact; this CPU has avx512_bf16: {cpu_decode.cpu_has('avx512_bf16')},"
                " unused: the widening is a shift)" if bf16 else "",
            )  # fmt: skip
            return stack
    logger.info("kernels: CPU decode layer by layer (the fused step does not apply: %s)", reason)
    return None
