"""The Mamba-2 mixer (Nemotron-H, Bamba): input projection, causal conv1d with a carried
window, the SSD scan (chunked for prefill, one step for decode) and the gated RMSNorm.

Owner: layers. State lives in the SSM slot pool; this block reads and writes the slot of each
sequence named by the batch metadata, through the `KernelOps` recurrent ops.

Invariants:
- Parameter names and layouts equal transformers' (`in_proj`, `conv1d.weight [C, 1, K]`,
  `conv1d.bias`, `dt_bias`, `A_log`, `D`, `norm.weight`, `out_proj`); `in_proj` rows are
  `[gate z (I) | x B C (conv_dim) | dt (H)]`.
- Decode rows (the first `meta.num_decode`) take one recurrent step each; the
  `meta.num_sequential` rows after them (a speculative verify: a decode row with its drafts)
  take one step per token through the same decode step (`recurrent_verify.py`); every prefill
  chunk runs the chunked scan from its sequence's carried state (zero when it starts at
  position 0), so chunked prefill is exact up to rounding.
- dt: `softplus(dt + dt_bias)`, clamped to `prefill_dt_limit` in the chunked scan only, as
  transformers does (its decode step does not clamp). Nemotron-H's transformers mixer clamps
  prefill dt at `time_step_min`; Bamba's at the config's `time_step_limit`.
- The gated RMSNorm normalises `y * silu(z)` per group of `I / n_groups` channels, in float32.
- Per-slot state: conv window `[conv_dim, K]` (model dtype), SSM state `[H, P, N]` (float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metrale.cache.ssm_pool import SsmLayerSpec
from metrale.kernels import KernelOps
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.recurrent_verify import RecurrentVerify, SsmState


@dataclass(frozen=True)
class Mamba2Spec:
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    eps: float
    use_conv_bias: bool = True
    use_bias: bool = False
    activation: str = "silu"
    prefill_dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    def state_spec(self) -> SsmLayerSpec:
        return SsmLayerSpec(
            conv_shape=(self.conv_dim, self.conv_kernel),
            state_shape=(self.num_heads, self.head_dim, self.state_size),
        )


class GatedGroupRMSNorm(nn.Module):
    """`weight * groupnorm(x * silu(z))` with RMS statistics per group, in float32."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(h.shape).to(dtype)


class Conv1dWeights(nn.Module):
    """Holds `weight [C, 1, K]` and `bias` under transformers' names (`conv1d.*`)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


@dataclass(frozen=True)
class PrefillRows:
    """The prefill chunks after a batch's decode rows: their first token row, each chunk's
    start relative to it (`query_start_loc` rebased, one more entry than chunks), their slots
    (host) and whether each continues a carried state."""

    first: int
    query_start_loc: list[int]
    slots: list[int]
    has_initial_state: list[bool]


def recurrent_rows(
    meta: AttentionMetadata, layer: str
) -> tuple[torch.Tensor, RecurrentVerify | None, PrefillRows | None]:
    """How a recurrent layer splits the batch: the slots of the `meta.num_decode` decode rows
    (device), the `meta.num_sequential` rows after them that run token by token (a verify:
    None when there are none), and the prefill chunks after those (None when there are none).

    Reads no host list for a decode-only batch (the sequence count is the shape of
    `meta.seq_lens`), so a CUDA-graph body, whose metadata has no host lists, can call it."""
    if meta.ssm_slots is None:
        raise ValueError(f"a {layer} layer needs SSM slots in the batch metadata")
    nd = meta.num_decode
    sequential = meta.ssm_verify if meta.num_sequential else None
    if meta.num_sequential and sequential is None:
        raise ValueError(f"a {layer} layer got sequential rows without their verify layout")
    ns = nd + meta.num_sequential
    if ns == meta.seq_lens.shape[0]:
        return meta.ssm_slots[:nd], sequential, None
    if meta.ssm_slots_host is None:
        raise ValueError(f"a {layer} layer needs host SSM slots for its prefill chunks")
    first = meta.query_start_loc_host[ns]
    prefill = PrefillRows(
        first=first,
        query_start_loc=[q - first for q in meta.query_start_loc_host[ns:]],
        slots=meta.ssm_slots_host[ns:],
        has_initial_state=(meta.ssm_has_initial_state or [])[ns:],
    )
    return meta.ssm_slots[:nd], sequential, prefill


class Mamba2Mixer(nn.Module):
    def __init__(self, spec: Mamba2Spec, ops: KernelOps) -> None:
        super().__init__()
        if spec.num_heads % spec.n_groups:
            raise ValueError(
                f"mamba heads ({spec.num_heads}) must be a multiple of n_groups ({spec.n_groups})"
            )
        self.spec = spec
        i, h = spec.intermediate, spec.num_heads
        self.in_proj = nn.Linear(spec.hidden_size, i + spec.conv_dim + h, bias=spec.use_bias)
        self.conv1d = Conv1dWeights(spec.conv_dim, spec.conv_kernel, spec.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.A_log = nn.Parameter(torch.empty(h))
        self.D = nn.Parameter(torch.empty(h))
        self.norm = GatedGroupRMSNorm(i, i // spec.n_groups, spec.eps)
        self.out_proj = nn.Linear(i, spec.hidden_size, bias=spec.use_bias)
        self.ops = ops

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: SsmState) -> torch.Tensor:
        s = self.spec
        conv_states, ssm_states = state
        slots, sequential, prefill = recurrent_rows(meta, "Mamba-2")
        tokens = x.shape[0]
        gate, xbc, dt = self.in_proj(x).split([s.intermediate, s.conv_dim, s.num_heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        a = -torch.exp(self.A_log.float())
        nd = meta.num_decode
        xbc_out = torch.empty_like(xbc)
        y = torch.empty(tokens, s.num_heads, s.head_dim, dtype=torch.float32, device=x.device)
        if nd:
            xbc_out[:nd], y[:nd] = self.recurrent_step((xbc[:nd], dt[:nd]), state, slots)
        if sequential is not None:
            sequential.run(self, state, (xbc, dt), (xbc_out, y))
        if prefill is not None:
            first, qsl = prefill.first, prefill.query_start_loc
            slots_host, initial = prefill.slots, prefill.has_initial_state
            xbc_out[first:] = self.ops.causal_conv1d_varlen(
                xbc[first:], weight, self.conv1d.bias, conv_states, qsl, slots_host, initial,
                s.activation,
            )  # fmt: skip
            xs, b, c = self._split(xbc_out[first:])
            y[first:] = self.ops.mamba2_chunk_scan_varlen(
                xs, dt[first:], a, b, c, self.D, self.dt_bias, s.prefill_dt_limit, s.chunk_size,
                ssm_states, qsl, slots_host, initial,
            )  # fmt: skip
        out = self.norm(y.view(tokens, s.intermediate), gate)
        return self.out_proj(out.to(x.dtype))

    def recurrent_step(
        self, inputs: tuple[torch.Tensor, ...], state: SsmState, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of `n` rows: `inputs` = (pre-conv `xbc [n, conv_dim]`, raw
        `dt [n, H]`); returns (conv output `[n, conv_dim]`, float32 `y [n, H, P]`)."""
        s = self.spec
        xbc, dt = inputs
        conv_states, ssm_states = state
        conv = self.ops.causal_conv1d_update(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_states, slots, s.activation
        )
        xs, b, c = self._split(conv)
        a = -torch.exp(self.A_log.float())
        y = self.ops.mamba2_state_update(
            xs, dt, a, b, c, self.D, self.dt_bias, ssm_states, slots
        ).float()
        return conv, y

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        n = xbc.shape[0]
        gs = s.n_groups * s.state_size
        xs, b, c = xbc.split([s.intermediate, gs, gs], dim=-1)
        return (
            xs.reshape(n, s.num_heads, s.head_dim),
            b.reshape(n, s.n_groups, s.state_size),
            c.reshape(n, s.n_groups, s.state_size),
        )
