"""Triton kernels for the recurrent layers' decode step (causal conv1d update, Mamba-2
selective state update, gated-delta-rule update), each reading and writing its rows' pool
slots in place; the helpers they share with the prefill kernels (`triton_ssm_prefill.py`).

Owner: kernels. Each computes the function of its torch reference in `ssm_reference.py` (the
op of the same name); `tests/gpu/test_ssm_kernels.py` checks them against it.

Invariants:
- Decode: row `i` reads and writes pool slot `slots[i]` (`conv_states [S, C, K]` in the model
  dtype, SSM states float32) and nothing else; a row whose slot is negative is padding (a
  CUDA-graph row past the real batch): it writes no state, and its output row is finite (zero
  state) but meaningless. No two real rows of one launch may share a slot (the model engine
  checks it). No host reads: the decode kernels are capturable, `slots` a graph input.
- The math runs in float32 (the references round some steps to the model dtype; the kernels
  round only dt, as the reference's prefill, and their outputs). Outputs are new contiguous
  tensors (Mamba-2 prefill: float32, as the reference). Inputs may be strided views (the
  layers pass splits of one projection) as long as the last dimension is dense.
- dt (Mamba-2): `softplus(dt + dt_bias)` (threshold 20, as `F.softplus`); prefill clamps it to
  `dt_limit`, decode does not, as the references; gated delta: q and k l2-normalised (eps
  1e-6) and q scaled by `Dk ** -0.5`, as `ssm_reference._gdn_prepare`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import ACTIVATIONS, NO_ACTIVATION, _activate

#: Activation name -> the conv kernels' constexpr code (`_activate`'s).
_ACTIVATIONS: dict[str | None, int] = {
    None: NO_ACTIVATION,
    **{name: ACTIVATIONS[name] for name in ("silu", "swish", "relu", "relu2")},
}


def _activation_code(activation: str | None) -> int:
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"causal_conv1d_update (Triton): unsupported activation '{activation}' "
            f"(have {sorted(str(a) for a in _ACTIVATIONS)})"
        )
    return _ACTIVATIONS[activation]


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_slots(slots: torch.Tensor, rows: int, op: str) -> None:
    if slots.dim() != 1 or slots.shape[0] != rows:
        raise ValueError(f"{op}: slots must be [{rows}] (one per row), got {tuple(slots.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: slots must be int32 or int64, got {slots.dtype}")


def _check_conv(op: str, x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> int:
    """The conv ops' operand checks; returns the conv width K."""
    channels, width = x.shape[1], weight.shape[-1]
    if weight.shape != (channels, width) or conv_states.shape[1:] != (channels, width):
        raise ValueError(
            f"{op}: weight {tuple(weight.shape)} and conv states "
            f"{tuple(conv_states.shape)} do not match {channels} channels"
        )
    if not conv_states.is_contiguous():
        raise ValueError(f"{op}: conv states must be contiguous (written in place)")
    return width


def _check_states(op: str, name: str, states: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A recurrent pool's states: `[S, *shape]` float32, contiguous (written in place)."""
    if states.shape[1:] != shape or states.dtype != torch.float32:
        dims = ", ".join(str(d) for d in shape)
        raise ValueError(
            f"{op}: {name} {tuple(states.shape)} {states.dtype} do not match [S, {dims}] float32"
        )
    if not states.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (written in place)")


def _check_mamba2(
    op: str, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    ssm_states: torch.Tensor,
) -> None:  # fmt: skip
    """The Mamba-2 ops' operand checks: `x [n, H, P]`, `dt [n, H]`, `b`/`c [n, G, N]` with G
    dividing H, float32 contiguous `ssm_states [S, H, P, N]`."""
    rows, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    _check_states(op, "SSM states", ssm_states, (heads, head_dim, d_state))
    if heads % groups or c.shape != b.shape or dt.shape != (rows, heads):
        raise ValueError(
            f"{op}: inconsistent shapes x {tuple(x.shape)}, dt "
            f"{tuple(dt.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}"
        )


def _check_gated_delta(
    op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, ssm_states: torch.Tensor,
) -> None:  # fmt: skip
    """The gated-delta ops' operand checks: `q`/`k [n, Hk, Dk]`, `v [n, Hv, Dv]` with Hk
    dividing Hv, `g`/`beta [n, Hv]`, float32 contiguous `ssm_states [S, Hv, Dk, Dv]`."""
    rows, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v_heads % k_heads or g.shape != (rows, v_heads):
        raise ValueError(
            f"{op}: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, g {tuple(g.shape)}"
        )
    if beta.shape != (rows, v_heads):
        raise ValueError(f"{op}: beta {tuple(beta.shape)} is not [{rows}, {v_heads}]")
    _check_states(op, "states", ssm_states, (v_heads, dk, dv))


def _state_tile(rows: int, inner: int, budget: int) -> tuple[int, int]:
    """`(tile, inner_pow2)`: a state tile of `tile x inner_pow2` elements, at most `budget`
    (the scans' register budget) and at most `rows` rounded up to a power of two."""
    inner_pow = triton.next_power_of_2(inner)
    return max(1, min(triton.next_power_of_2(rows), max(1, budget // inner_pow))), inner_pow


@triton.jit
def _softplus(v):
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))


@triton.jit
def _decode_program(slots_ptr):
    """A decode program's `(row as int64, head, state tile, the row's pool slot)` (grid
    `(rows, heads, tiles)`; a negative slot is a padding row)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    return row.to(tl.int64), head, tile, slot


@triton.jit
def _mamba2_load(
    x_ptr, b_ptr, c_ptr, t, head, group, ps, ns, pmask, nmask,
    stride_xn, stride_xh, stride_bn, stride_bg, stride_cn, stride_cg,
):  # fmt: skip
    """Row `t`'s x (float32, this head's P tile) and its group's B and C (as stored)."""
    x = tl.load(x_ptr + t * stride_xn + head * stride_xh + ps, mask=pmask, other=0.0)
    x = x.to(tl.float32)
    b = tl.load(b_ptr + t * stride_bn + group * stride_bg + ns, mask=nmask, other=0.0)
    c = tl.load(c_ptr + t * stride_cn + group * stride_cg + ns, mask=nmask, other=0.0)
    return x, b, c


@triton.jit
def _mamba2_state(state, x, b, dt, decay):
    """One Mamba-2 step of a `[P, N]` state tile: the new state."""
    return state * decay + (dt * x)[:, None] * b.to(tl.float32)[None, :]


@triton.jit
def _mamba2_out(state, x, c, d):
    """A Mamba-2 step's output `y` (with the D skip) from its new state."""
    return tl.sum(state * c.to(tl.float32)[None, :], axis=1) + d * x


@triton.jit
def _gated_delta_load(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, head, khead, ks, vs, kmask, vmask,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_betan,
    scale, L2NORM: tl.constexpr,
):  # fmt: skip
    """Row `t`'s q (l2-normalised with L2NORM, scaled) and k (l2-normalised with L2NORM), its
    v tile, log decay g and beta, all float32."""
    q = tl.load(q_ptr + t * stride_qn + khead * stride_qh + ks, mask=kmask, other=0.0)
    k = tl.load(k_ptr + t * stride_kn + khead * stride_kh + ks, mask=kmask, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(v_ptr + t * stride_vn + head * stride_vh + vs, mask=vmask, other=0.0)
    v = v.to(tl.float32)
    g = tl.load(g_ptr + t * stride_gn + head).to(tl.float32)
    beta = tl.load(beta_ptr + t * stride_betan + head).to(tl.float32)
    return q, k, v, g, beta


@triton.jit
def _gated_delta_state(state, k, v, g, beta):
    """One gated-delta step of a `[Dk, V]` state tile: the new state (its output is
    `sum(state * q[:, None], axis=0)`)."""
    state = state * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    return state + k[:, None] * delta[None, :]


# --------------------------------------------------------------------------------------------
# Causal conv1d update
# --------------------------------------------------------------------------------------------


@triton.jit
def _conv1d_update_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    stride_x,
    stride_ss,
    C,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    row = tl.program_id(0)
    cblk = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    chans = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, KP)
    cmask = chans < C
    # Per channel (a vector: the interpreter rejects a scalar in a mask).
    valid = (chans * 0 + slot) >= 0
    slot = tl.maximum(slot, 0)
    base = state_ptr + slot * stride_ss + chans[:, None] * K
    # The window after the shift: taps 0..K-2 are the old taps 1..K-1, tap K-1 the new input.
    shifted = tl.load(
        base + taps[None, :] + 1,
        mask=(cmask & valid)[:, None] & (taps[None, :] + 1 < K),
        other=0.0,
    )
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + chans, mask=cmask, other=0.0)
    last = taps[None, :] == K - 1
    window = tl.where(last, x.to(state_ptr.dtype.element_ty)[:, None], shifted)
    tl.store(base + taps[None, :], window, mask=(cmask & valid)[:, None] & (taps[None, :] < K))
    w = tl.load(
        w_ptr + chans[:, None] * K + taps[None, :],
        mask=cmask[:, None] & (taps[None, :] < K),
        other=0.0,
    )
    y = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + chans, mask=cmask, other=0.0).to(tl.float32)
    y = _activate(y, ACT)
    tl.store(out_ptr + row.to(tl.int64) * C + chans, y.to(out_ptr.dtype.element_ty), mask=cmask)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
    slots: torch.Tensor, activation: str | None,
) -> torch.Tensor:  # fmt: skip
    """One new input per row `x [n, C]`: shift it into `conv_states[slots[i]]` (`[C, K]`, oldest
    first) in place and return the activated conv of the window, `[n, C]` in x's dtype."""
    n, channels = x.shape
    width = _check_conv("causal_conv1d_update", x, weight, conv_states)
    _check_slots(slots, n, "causal_conv1d_update")
    act = _activation_code(activation)
    x = _dense_last(x)
    weight = weight.contiguous()
    out = torch.empty((n, channels), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_c = min(256, triton.next_power_of_2(channels))
    grid = (n, triton.cdiv(channels, block_c))
    _conv1d_update_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, slots, out,
        x.stride(0), conv_states.stride(0), channels,
        K=width, KP=triton.next_power_of_2(width), BLOCK_C=block_c,
        HAS_BIAS=bias is not None, ACT=act,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Mamba-2 selective state update
# --------------------------------------------------------------------------------------------


@triton.jit
def _mamba2_update_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_ptr,
    stride_xn, stride_xh, stride_dtn, stride_bn, stride_bg, stride_cn, stride_cg, stride_ss,
    H, P, N, HEADS_PER_GROUP,
    BLOCK_P: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    row64, head, pblk, slot = _decode_program(slots_ptr)
    group = head // HEADS_PER_GROUP
    dt = tl.load(dt_ptr + row64 * stride_dtn + head).to(tl.float32)
    dt = _softplus(dt + tl.load(dt_bias_ptr + head).to(tl.float32))
    decay = tl.exp(dt * tl.load(a_ptr + head).to(tl.float32))
    d = tl.load(d_ptr + head).to(tl.float32)
    ps = pblk * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, NP)
    pmask = ps < P
    nmask = ns < N
    valid = (ps * 0 + slot) >= 0  # a vector: the interpreter rejects a scalar in a mask
    slot = tl.maximum(slot, 0)
    x, b, c = _mamba2_load(x_ptr, b_ptr, c_ptr, row64, head, group, ps, ns, pmask, nmask,
                           stride_xn, stride_xh, stride_bn, stride_bg, stride_cn, stride_cg)  # fmt: skip
    smask = (pmask & valid)[:, None] & nmask[None, :]
    sptr = state_ptr + slot * stride_ss + (head * P + ps)[:, None] * N + ns[None, :]
    state = tl.load(sptr, mask=smask, other=0.0)
    state = _mamba2_state(state, x, b, dt, decay)
    tl.store(sptr, state, mask=smask)
    y = _mamba2_out(state, x, c, d)
    tl.store(out_ptr + (row64 * H + head) * P + ps, y.to(out_ptr.dtype.element_ty), mask=pmask)


def mamba2_state_update(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    d: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One Mamba-2 step per row: `x [n, H, P]`, raw `dt [n, H]`, `a [H]`, `b`/`c [n, G, N]`,
    `d`/`dt_bias [H]`, float32 `ssm_states [S, H, P, N]` updated in place at `slots`; returns
    `y [n, H, P]` (with the D skip) in x's dtype."""
    n, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    _check_mamba2("mamba2_state_update", x, dt, b, c, ssm_states)
    _check_slots(slots, n, "mamba2_state_update")
    x, dt, b, c = (_dense_last(t) for t in (x, dt, b, c))
    a, d, dt_bias = (t.contiguous() for t in (a, d, dt_bias))
    out = torch.empty((n, heads, head_dim), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_p, n_pow = _state_tile(head_dim, d_state, 4096)
    grid = (n, heads, triton.cdiv(head_dim, block_p))
    _mamba2_update_kernel[grid](
        x, dt, a, b, c, d, dt_bias, ssm_states, slots, out,
        x.stride(0), x.stride(1), dt.stride(0), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), ssm_states.stride(0),
        heads, head_dim, d_state, heads // groups,
        BLOCK_P=block_p, NP=n_pow,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Gated delta rule update
# --------------------------------------------------------------------------------------------


@triton.jit
def _gated_delta_update_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_betan,
    stride_ss, HV, DK, DV, RATIO, scale,
    L2NORM: tl.constexpr, DKP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row64, head, vblk, slot = _decode_program(slots_ptr)
    khead = head // RATIO
    ks = tl.arange(0, DKP)
    vs = vblk * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = ks < DK
    vmask = vs < DV
    valid = (ks * 0 + slot) >= 0  # a vector: the interpreter rejects a scalar in a mask
    slot = tl.maximum(slot, 0)
    q, k, v, g, beta = _gated_delta_load(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row64, head, khead, ks, vs, kmask, vmask,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_betan,
        scale, L2NORM,
    )  # fmt: skip
    smask = (kmask & valid)[:, None] & vmask[None, :]
    sptr = state_ptr + slot * stride_ss + (head * DK + ks)[:, None] * DV + vs[None, :]
    state = tl.load(sptr, mask=smask, other=0.0)
    state = _gated_delta_state(state, k, v, g, beta)
    tl.store(sptr, state, mask=smask)
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (row64 * HV + head) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)


def gated_delta_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_states: torch.Tensor, slots: torch.Tensor, use_qk_l2norm: bool = True,
) -> torch.Tensor:  # fmt: skip
    """One gated-delta step per row: `q`/`k [n, Hk, Dk]`, `v [n, Hv, Dv]`, log decay and
    `beta [n, Hv]`, float32 `ssm_states [S, Hv, Dk, Dv]` updated in place at `slots`; returns
    `o [n, Hv, Dv]` in v's dtype."""
    n, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    _check_gated_delta("gated_delta_update", q, k, v, g, beta, ssm_states)
    _check_slots(slots, n, "gated_delta_update")
    q, k, v, g, beta = (_dense_last(t) for t in (q, k, v, g, beta))
    out = torch.empty((n, v_heads, dv), dtype=v.dtype, device=v.device)
    if n == 0:
        return out
    block_v, dkp = _state_tile(dv, dk, 4096)
    grid = (n, v_heads, triton.cdiv(dv, block_v))
    _gated_delta_update_kernel[grid](
        q, k, v, g, beta, ssm_states, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), ssm_states.stride(0),
        v_heads, dk, dv, v_heads // k_heads, dk**-0.5,
        L2NORM=use_qk_l2norm, DKP=dkp, BLOCK_V=block_v,
    )  # fmt: skip
    return out
