"""The gated delta net (Qwen3-Next linear attention): fused q/k/v/z and b/a projections, causal
conv1d with a carried window over q|k|v, the gated delta rule (chunked for prefill, recurrent
for decode) and the gated RMSNorm before `out_proj`.

Owner: layers. State lives in the SSM slot pool, per sequence slot named by the metadata.

Invariants:
- Parameter names equal transformers' (`in_proj_qkvz`, `in_proj_ba`, `conv1d.weight`,
  `dt_bias`, `A_log`, `norm.weight`, `out_proj`). `in_proj_qkvz` rows are grouped per key
  head: `[q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)]` with `r = Hv / Hk`; `in_proj_ba` rows per key
  head `[b (r) | a (r)]`. The conv runs over the channels `[q (Hk*Dk) | k | v (Hv*Dv)]`.
- `beta = sigmoid(b)`, log decay `g = -exp(A_log) * softplus(a + dt_bias)`; q and k are
  l2-normalised in float32 and q scaled by `Dk ** -0.5` inside the op.
- Decode rows take one recurrent step; the rows of a speculative verify (`num_sequential`
  after them) one step per token through the same decode step (`recurrent_verify.py`);
  prefill chunks run the chunked rule from the carried state (zero when they start at
  position 0), so chunked prefill is exact up to rounding.
- Per-slot state: conv window `[2*Hk*Dk + Hv*Dv, K]` (model dtype), recurrent state
  `[Hv, Dk, Dv]` (float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metrale.cache.ssm_pool import SsmLayerSpec
from metrale.kernels import KernelOps
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.mamba2 import Conv1dWeights, recurrent_rows
from metrale.layers.recurrent_verify import SsmState


@dataclass(frozen=True)
class GatedDeltaSpec:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    activation: str = "silu"
    chunk_size: int = 64

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_spec(self) -> SsmLayerSpec:
        return SsmLayerSpec(
            conv_shape=(self.conv_dim, self.conv_kernel),
            state_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )


class GatedRMSNorm(nn.Module):
    """Norm before gate: `(weight * rmsnorm(x)) * silu(z)`, over the last dimension."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: GatedDeltaSpec, ops: KernelOps) -> None:
        super().__init__()
        if spec.num_v_heads % spec.num_k_heads:
            raise ValueError(
                f"linear value heads ({spec.num_v_heads}) must be a multiple of key heads "
                f"({spec.num_k_heads})"
            )
        self.spec = spec
        self.in_proj_qkvz = nn.Linear(
            spec.hidden_size, 2 * spec.key_dim + 2 * spec.value_dim, bias=False
        )
        self.in_proj_ba = nn.Linear(spec.hidden_size, 2 * spec.num_v_heads, bias=False)
        self.conv1d = Conv1dWeights(spec.conv_dim, spec.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(spec.num_v_heads))
        self.norm = GatedRMSNorm(spec.head_v_dim, spec.eps)
        self.out_proj = nn.Linear(spec.value_dim, spec.hidden_size, bias=False)
        self.ops = ops

    def _unpack(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(mixed_qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])`."""
        s = self.spec
        tokens = x.shape[0]
        r = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(tokens, s.num_k_heads, -1)
        q, k, v, z = qkvz.split(
            [s.head_k_dim, s.head_k_dim, r * s.head_v_dim, r * s.head_v_dim], -1
        )
        b, a = self.in_proj_ba(x).view(tokens, s.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat(
            [q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1
        )
        return (
            mixed,
            z.reshape(tokens, s.num_v_heads, s.head_v_dim),
            b.reshape(tokens, s.num_v_heads),
            a.reshape(tokens, s.num_v_heads),
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: SsmState) -> torch.Tensor:
        s = self.spec
        conv_states, ssm_states = state
        slots, sequential, prefill = recurrent_rows(meta, "gated delta net")
        tokens = x.shape[0]
        mixed, z, b, a = self._unpack(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)
        conv_out = torch.empty_like(mixed)
        out = torch.empty(tokens, s.num_v_heads, s.head_v_dim, dtype=x.dtype, device=x.device)
        nd = meta.num_decode
        if nd:
            conv_out[:nd], out[:nd] = self.recurrent_step(
                (mixed[:nd], g[:nd], beta[:nd]), state, slots
            )
        if sequential is not None:
            sequential.run(self, state, (mixed, g, beta), (conv_out, out))
        if prefill is not None:
            first, qsl = prefill.first, prefill.query_start_loc
            slots_host, initial = prefill.slots, prefill.has_initial_state
            conv_out[first:] = self.ops.causal_conv1d_varlen(
                mixed[first:], weight, None, conv_states, qsl, slots_host, initial, s.activation
            )
            q, k, v = self._split(conv_out[first:])
            out[first:] = self.ops.gated_delta_chunk_varlen(
                q, k, v, g[first:], beta[first:], ssm_states, qsl, slots_host, initial,
                chunk_size=s.chunk_size, use_qk_l2norm=True,
            )  # fmt: skip
        normed = self.norm(out, z)
        return self.out_proj(normed.reshape(tokens, s.value_dim))

    def recurrent_step(
        self, inputs: tuple[torch.Tensor, ...], state: SsmState, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of `n` rows: `inputs` = (pre-conv `mixed_qkv [n, conv_dim]`,
        log decay `g [n, Hv]`, `beta [n, Hv]`); returns (conv output, `o [n, Hv, Dv]`)."""
        mixed, g, beta = inputs
        conv_states, ssm_states = state
        conv = self.ops.causal_conv1d_update(
            mixed, self.conv1d.weight.squeeze(1), None, conv_states, slots, self.spec.activation
        )
        q, k, v = self._split(conv)
        out = self.ops.gated_delta_update(q, k, v, g, beta, ssm_states, slots, use_qk_l2norm=True)
        return conv, out

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        n = mixed.shape[0]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        return (
            q.reshape(n, s.num_k_heads, s.head_k_dim),
            k.reshape(n, s.num_k_heads, s.head_k_dim),
            v.reshape(n, s.num_v_heads, s.head_v_dim),
        )
