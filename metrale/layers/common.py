"""Building blocks shared by the decoder families: RMSNorm, the gated MLP, the paged
self-attention block (fused QKV projection; optional q/k norm, rotary and the KV write as one
kernel op; attention), and the pre-norm decoder layer's frame (`PreNormLayer`).

Owner: layers. Each block calls hot ops only through the `KernelOps` it was built with.

Invariants:
- Parameter names under each block follow transformers' names (`q_norm`, `o_proj`,
  `down_proj`, ...) except the fused `qkv_proj` and `gate_up_proj`, which the loader fills
  from the separate checkpoint tensors.
- Attention reads and writes K/V only through the metadata's slots and block tables, and
  passes a float8 cache's scales to every KV op; a layer whose scales await calibration
  runs its rotary step unfused once, so the scales are set from the rotated k before the
  first write (`metrale.cache.kv_cache`).
- A `PreNormLayer` threads the residual stream the same way in every family: `pre_norm` on
  entry, the fused residual add before the MLP, `(hidden, residual)` out.
- The four projections run through `project` / `project_silu_mul` (`fp8_linear`): an
  `nn.Linear` through `ops.linear`, an `Fp8Linear` (FP8 weights) through `ops.linear_fp8`.
- With `ops.prefetch_l2` (an experiment, off by default), `PagedSelfAttention` hints o_proj's
  and its layer's MLP weights into the GPU's L2 right after the QKV projection, so they
  stream while the attention kernels run; the hint changes no value.
- `GatedMLP` and `PagedSelfAttention` carry `lora` (a `metrale.layers.lora.LoraLayer`, None
  unless the model serves adapters); when a forward routes rows to adapters, each base
  projection's output gets those rows' LoRA deltas before it is used, through
  `LoraLayer.project` (on CUDA at few rows one op per projection, the deltas added in the
  GEMV's stores; else the down projection runs unfused, on the materialised SiLU-and-mul).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from metrale.kernels import KernelOps
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.fp8_linear import project, project_silu_mul
from metrale.layers.lora import LoraLayer
from metrale.layers.rotary import RotaryEmbedding
from metrale.model_config import ModelConfig

#: What a layer's mixer reads and writes: `(k_cache, v_cache)` for attention, the SSM pool's
#: `(conv_states, ssm_states)` for a recurrent mixer, None for a layer that holds nothing.
LayerCache = tuple[torch.Tensor, torch.Tensor] | None
#: One attention layer's paged caches: `(k_cache, v_cache)`; the pool's entries are
#: `metrale.cache.kv_cache.KvLayer`s, which also carry float8 scales (`kv_scale_kwargs`).
KvCache = tuple[torch.Tensor, torch.Tensor]
#: A model's per-layer pool tensors, in layer order: its attention layers' `KvCache`s
#: (`kv_caches`), or its recurrent layers' `(conv_states, ssm_states)` (`ssm_states`).
LayerCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_scale_kwargs(kv: KvCache) -> dict[str, torch.Tensor]:
    """The `k_scale` / `v_scale` keywords of the KV ops for this layer's cache: its scales
    when it is a float8 `KvLayer`, none for a cache in the model dtype (or a bare pair)."""
    scale_kwargs = getattr(kv, "scale_kwargs", None)
    return scale_kwargs() if scale_kwargs is not None else {}


def kv_calibration_pending(kv: KvCache) -> bool:
    """Whether this layer's float8 scales wait for the rows of this write (`KvLayer`)."""
    return bool(getattr(kv, "calibration_pending", False))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def pre_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's entry, for any norm with `forward` and `forward_add`: `(norm(x), x)`
    in the first layer, else the fused residual add `(norm(residual + x), residual + x)`."""
    if residual is None:
        return norm(x), x
    return norm.forward_add(x, residual)


class PreNormLayer(nn.Module, ABC):
    """A decoder layer's frame: `norm -> mixer -> fused residual-add norm -> MLP`.

    Subclasses implement `mix` (attention, a recurrent mixer, or a block with no cache) and
    keep their checkpoint's module names, given by `input_norm_name`, `post_norm_name` and
    `mlp_name`; `post_norm_name = None` ends the layer after the mixer (Nemotron-H's blocks).
    """

    input_norm_name = "input_layernorm"
    post_norm_name: str | None = "post_attention_layernorm"
    mlp_name = "mlp"

    @abstractmethod
    def mix(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache
    ) -> torch.Tensor:
        """The layer's mixer on the pre-normed hidden rows."""

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = pre_norm(getattr(self, self.input_norm_name), hidden, residual)
        hidden = self.mix(positions, hidden, meta, cache)
        if self.post_norm_name is None:
            return hidden, residual
        hidden, residual = getattr(self, self.post_norm_name).forward_add(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one projection."""

    #: The layer's LoRA slots (set by `metrale.model_engine.lora`); None: base model only.
    lora: LoraLayer | None = None

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, act: str, ops: KernelOps
    ) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation '{act}' (supported: silu)")
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops, gate_up, down = self.ops, self.gate_up_proj, self.down_proj
        lora = self.lora
        if lora is None or not lora.active():
            return project_silu_mul(ops, down, project(ops, gate_up, x))
        inter = gate_up.out_features // 2
        h = lora.project(ops, gate_up, x, [("gate_proj", 0, inter), ("up_proj", inter, inter)])
        if not lora.adapts("down_proj"):
            return project_silu_mul(ops, down, h)
        return lora.project(ops, down, h, [("down_proj", 0, down.out_features)], act=True)


class AttentionProjections(nn.Module):
    """The head geometry and the two projections of a paged attention block: the fused
    `qkv_proj` (`q_factor` 2: each query head carries an output gate of the same size) and
    `o_proj`; `scale` is `head_dim ** -0.5`; the block's rotary table and kernel ops."""

    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding | None, ops: KernelOps, o_bias: bool,
        q_factor: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        self.rotary = rotary
        self.ops = ops
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, q_factor * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.scale = self.head_dim**-0.5


class PagedSelfAttention(AttentionProjections):
    #: The layer's LoRA slots (set by `metrale.model_engine.lora`); None: base model only.
    lora: LoraLayer | None = None
    #: The MLPs that run after this block in its layer (a plain tuple, not submodules): with
    #: `ops.prefetch_l2`, their weights are hinted into L2 after o_proj's, during attention.
    prefetch_mlp: tuple[GatedMLP, ...] = ()

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding | None, ops: KernelOps
    ) -> None:
        super().__init__(cfg, rotary, ops, o_bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm = cfg.qk_norm
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, kv: KvCache
    ) -> torch.Tensor:
        tokens = x.shape[0]
        lora = self.lora if self.lora is not None and self.lora.active() else None
        if lora is not None:
            q_n, kv_n = self.q_size, self.kv_size
            qkv = lora.project(
                self.ops, self.qkv_proj, x,
                [("q_proj", 0, q_n), ("k_proj", q_n, kv_n), ("v_proj", q_n + kv_n, kv_n)],
            )  # fmt: skip
        else:
            qkv = project(self.ops, self.qkv_proj, x)
        if self.ops.prefetch_l2 is not None:  # the next weights stream while attention runs
            self.ops.prefetch_l2(tokens, self._weights_after_attention())
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q = self._prepare_q_and_write_kv(positions, q, k, v, kv, meta.slot_mapping)
        k_cache, v_cache = kv
        out = self.ops.paged_attention(
            q, k_cache, v_cache, meta, self.scale, self.sliding_window, **kv_scale_kwargs(kv)
        )
        flat = out.reshape(tokens, self.q_size)
        if lora is not None:
            return lora.project(
                self.ops, self.o_proj, flat, [("o_proj", 0, self.o_proj.out_features)]
            )
        return project(self.ops, self.o_proj, flat)

    def _weights_after_attention(self) -> list[torch.Tensor]:
        """The weights the layer reads after attention, in order: o_proj's, then its MLP's
        (resolved at call time: FP8 conversion replaces the projection modules)."""
        weights = [self.o_proj.weight]
        for mlp in self.prefetch_mlp:
            weights += [mlp.gate_up_proj.weight, mlp.down_proj.weight]
        return weights

    def _prepare_q_and_write_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Optional per-head q/k RMSNorm and rotary of q and k, with the rotated k and v
        stored in the cache; returns the query. With a rotary embedding this is one kernel op
        (rotated k is never materialised); without one (a model with no positional encoding,
        e.g. Nemotron-H) the norms, then `write_kv`. A float8 cache awaiting calibration
        takes the unfused path once: the rotated k and v set the scales, then `write_kv`."""
        k_cache, v_cache = kv
        rotary = self.rotary
        scales = kv_scale_kwargs(kv)
        if rotary is None or kv_calibration_pending(kv):
            if rotary is not None and self.qk_norm:
                q, k = self.ops.qk_norm_rotary(
                    positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                    rotary.cos_sin, rotary.rotary_dim,
                )  # fmt: skip
            elif rotary is not None:
                q, k = self.ops.rotary_embedding(positions, q, k, rotary.cos_sin, rotary.rotary_dim)
            elif self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if kv_calibration_pending(kv):
                kv.calibrate(k, v)  # type: ignore[attr-defined]
            self.ops.write_kv(k, v, k_cache, v_cache, slot_mapping, **scales)
            return q
        if self.qk_norm:
            return self.ops.qk_norm_rotary_write_kv(
                positions, q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                rotary.cos_sin, rotary.rotary_dim, k_cache, v_cache, slot_mapping, **scales,
            )  # fmt: skip
        return self.ops.rotary_write_kv(
            positions, q, k, v, rotary.cos_sin, rotary.rotary_dim, k_cache, v_cache,
            slot_mapping, **scales,
        )  # fmt: skip
