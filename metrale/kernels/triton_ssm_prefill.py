"""Triton kernels for the recurrent layers' prefill: the causal conv1d over varlen chunks,
and the Mamba-2 and gated-delta recurrences of short chunks, each starting from and leaving
its sequence's pool slot state.

Owner: kernels. Each computes the function of its torch reference in `ssm_reference.py` (the
op of the same name); `tests/gpu/test_ssm_kernels.py` checks them against it. The decode
kernels and the helpers both use are in `triton_ssm.py`, whose numeric invariants (float32
math, dt and q/k handling, strided inputs) hold here too.

Invariants:
- Prefill: chunk `b` (rows `query_start_loc[b] : query_start_loc[b + 1]`, host lists as the
  references take them, sent to the device in one copy) starts from `slots[b]`'s state, or
  from zeros when `has_initial_state[b]` is False, and leaves its final state there. The
  scans walk a chunk token by token (one program per sequence, head and state tile), so a
  call whose longest chunk exceeds `SCAN_MAX_TOKENS` goes to the torch chunked form instead
  (same function; matmuls over chunks win on long chunks).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import _activate
from metrale.kernels.triton_ssm import (
    _activation_code,
    _check_conv,
    _check_gated_delta,
    _check_mamba2,
    _dense_last,
    _gated_delta_load,
    _gated_delta_state,
    _mamba2_load,
    _mamba2_out,
    _mamba2_state,
    _softplus,
    _state_tile,
)

#: Longest prefill chunk the sequential scans take (tokens): one program walks its chunk token
#: by token, so past this the torch chunked form (matmuls over chunks) is the faster one and
#: `mamba2_chunk_scan_varlen` / `gated_delta_chunk_varlen` route the call there (the layer
#: sees one op; `triton_linear` routes by row count the same way).
SCAN_MAX_TOKENS = 256


def _varlen_layout(
    query_start_loc: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
    device: torch.device,
    op: str,
) -> tuple[torch.Tensor, int]:
    """One int64 device tensor `[qsl (B + 1) | slots (B) | has_initial (B)]` (one host copy)
    and the longest chunk."""
    seqs = len(slots)
    if len(query_start_loc) != seqs + 1 or len(has_initial_state) != seqs:
        raise ValueError(
            f"{op}: {len(query_start_loc)} query_start_loc entries, {seqs} slots and "
            f"{len(has_initial_state)} has_initial_state flags do not describe one batch"
        )
    if any(s < 0 for s in slots):
        raise ValueError(f"{op}: every prefill chunk needs a pool slot (>= 0), got {list(slots)}")
    packed = [
        *map(int, query_start_loc),
        *map(int, slots),
        *(int(bool(h)) for h in has_initial_state),
    ]
    longest = max((b - a for a, b in itertools.pairwise(query_start_loc)), default=0)
    return torch.tensor(packed, dtype=torch.int64).to(device, non_blocking=True), longest


@triton.jit
def _chunk_of(layout_ptr, seq, num_seqs):
    """Chunk `seq`'s `(start, end, slot, has_initial_state)` from `_varlen_layout`'s tensor."""
    start = tl.load(layout_ptr + seq)
    end = tl.load(layout_ptr + seq + 1)
    slot = tl.load(layout_ptr + num_seqs + 1 + seq)
    initial = tl.load(layout_ptr + 2 * num_seqs + 1 + seq)
    return start, end, slot, initial


@triton.jit
def _scan_program(layout_ptr, num_seqs):
    """A scan program's `(head, state tile, chunk start, end, slot, has_initial_state)` (grid
    `(sequences, heads, tiles)`)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    start, end, slot, initial = _chunk_of(layout_ptr, seq, num_seqs)
    return head, tile, start, end, slot, initial


def _torch_form(longest: int, op: str, *args: object, **kwargs: object) -> torch.Tensor | None:
    """The torch chunked form's result when the longest chunk is past `SCAN_MAX_TOKENS`
    (`ssm_reference.<op>`, same function), else None: the Triton scan takes the call."""
    if longest <= SCAN_MAX_TOKENS:
        return None
    from metrale.kernels import ssm_reference

    return getattr(ssm_reference, op)(*args, **kwargs)


@triton.jit
def _conv1d_varlen_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, layout_ptr, out_ptr, stride_x, stride_ss, num_seqs, C,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    cblk = tl.program_id(1)
    start, end, slot, initial = _chunk_of(layout_ptr, seq, num_seqs)
    length = end - start
    chans = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chans < C
    # Per channel (a vector: the interpreter rejects a scalar in a mask).
    carried = (chans * 0 + initial) != 0
    sbase = state_ptr + slot * stride_ss + chans * K
    if HAS_BIAS:
        bias = tl.load(b_ptr + chans, mask=cmask, other=0.0).to(tl.float32)
    # Output t reads inputs t - K + 1 .. t; a negative index is the carried window's tap
    # K + index (zero without a carried state).
    for t0 in range(0, length, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        tmask = ts < length
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for k in tl.static_range(K):
            src = ts + (k - K + 1)
            from_x = tl.load(
                x_ptr + (start + src)[:, None] * stride_x + chans[None, :],
                mask=(tmask & (src >= 0))[:, None] & cmask[None, :],
                other=0.0,
            ).to(tl.float32)
            from_state = tl.load(
                sbase[None, :] + (K + src)[:, None],
                mask=(tmask & (src < 0))[:, None] & (cmask & carried)[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(w_ptr + chans * K + k, mask=cmask, other=0.0).to(tl.float32)
            acc += (from_x + from_state) * w[None, :]
        if HAS_BIAS:
            acc += bias[None, :]
        acc = _activate(acc, ACT)
        tl.store(
            out_ptr + (start + ts)[:, None] * C + chans[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=tmask[:, None] & cmask[None, :],
        )
    # The new window: the last K inputs of (carried window | chunk), read before any write.
    taps = tl.arange(0, BLOCK_K)
    src = length - K + taps
    tap_ok = taps < K
    from_x = tl.load(
        x_ptr + (start + src)[None, :] * stride_x + chans[:, None],
        mask=cmask[:, None] & (tap_ok & (src >= 0))[None, :],
        other=0.0,
    )
    from_state = tl.load(
        sbase[:, None] + (K + src)[None, :],
        mask=(cmask & carried)[:, None] & (tap_ok & (src < 0))[None, :],
        other=0.0,
    )
    window = tl.where((src >= 0)[None, :], from_x.to(state_ptr.dtype.element_ty), from_state)
    tl.store(sbase[:, None] + taps[None, :], window, mask=cmask[:, None] & tap_ok[None, :])


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
    query_start_loc: Sequence[int], slots: Sequence[int], has_initial_state: Sequence[bool],
    activation: str | None,
) -> torch.Tensor:  # fmt: skip
    """Causal conv over each chunk's rows of `x [T, C]`, continuing from its window in
    `conv_states[slot]` (zero without a carried state) and leaving its last K inputs there;
    returns the activated conv `[T, C]` in x's dtype."""
    tokens, channels = x.shape
    width = _check_conv("causal_conv1d_varlen", x, weight, conv_states)
    act = _activation_code(activation)
    layout, _ = _varlen_layout(
        query_start_loc, slots, has_initial_state, x.device, "causal_conv1d_varlen"
    )
    x = _dense_last(x)
    weight = weight.contiguous()
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    if not slots or tokens == 0:
        return out
    block_c = min(64, triton.next_power_of_2(channels))
    grid = (len(slots), triton.cdiv(channels, block_c))
    _conv1d_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, layout, out,
        x.stride(0), conv_states.stride(0), len(slots), channels,
        K=width, BLOCK_T=32, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(width),
        HAS_BIAS=bias is not None, ACT=act,
    )  # fmt: skip
    return out


@triton.jit
def _mamba2_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr, layout_ptr, out_ptr,
    stride_xn, stride_xh, stride_dtn, stride_bn, stride_bg, stride_cn, stride_cg, stride_ss,
    num_seqs, H, P, N, HEADS_PER_GROUP, dt_min, dt_max,
    BLOCK_P: tl.constexpr, NP: tl.constexpr, DT_DTYPE: tl.constexpr,
):  # fmt: skip
    head, pblk, start, end, slot, initial = _scan_program(layout_ptr, num_seqs)
    group = head // HEADS_PER_GROUP
    ps = pblk * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, NP)
    pmask = ps < P
    nmask = ns < N
    carried = (ps * 0 + initial) != 0  # a vector: the interpreter rejects a scalar in a mask
    smask = pmask[:, None] & nmask[None, :]
    sptr = state_ptr + slot * stride_ss + (head * P + ps)[:, None] * N + ns[None, :]
    state = tl.load(sptr, mask=smask & carried[:, None], other=0.0)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    for t in range(start, end):
        t64 = t  # int64: the bounds are loaded from the int64 layout
        # softplus(dt + dt_bias) in dt's dtype, as the reference, then clamped in float32.
        dt = tl.load(dt_ptr + t64 * stride_dtn + head).to(tl.float32) + bias
        dt = dt.to(DT_DTYPE).to(tl.float32)
        dt = _softplus(dt).to(DT_DTYPE).to(tl.float32)
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x, b, c = _mamba2_load(x_ptr, b_ptr, c_ptr, t64, head, group, ps, ns, pmask, nmask,
                               stride_xn, stride_xh, stride_bn, stride_bg, stride_cn, stride_cg)  # fmt: skip
        state = _mamba2_state(state, x, b, dt, tl.exp(dt * a))
        y = _mamba2_out(state, x, c, d)
        tl.store(out_ptr + (t64 * H + head) * P + ps, y, mask=pmask)
    tl.store(sptr, state, mask=smask)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def mamba2_chunk_scan_varlen(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    d: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], chunk_size: int,
    ssm_states: torch.Tensor, query_start_loc: Sequence[int], slots: Sequence[int],
    has_initial_state: Sequence[bool],
) -> torch.Tensor:  # fmt: skip
    """Mamba-2 over prefill rows, as `ssm_reference.mamba2_chunk_scan_varlen`: float32
    `y [T, H, P]` with the D skip, each chunk's final state left in `ssm_states[slot]`.
    Chunks of at most `SCAN_MAX_TOKENS` run the sequential Triton scan; a longer one sends the
    call to the torch chunked form (`chunk_size` is its chunk length only)."""
    tokens, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    _check_mamba2("mamba2_chunk_scan_varlen", x, dt, b, c, ssm_states)
    if dt.dtype not in _TL_DTYPES:
        raise ValueError(f"mamba2_chunk_scan_varlen: unsupported dt dtype {dt.dtype}")
    layout, longest = _varlen_layout(
        query_start_loc, slots, has_initial_state, x.device, "mamba2_chunk_scan_varlen"
    )
    reference = _torch_form(
        longest, "mamba2_chunk_scan_varlen", x, dt, a, b, c, d, dt_bias, dt_limit, chunk_size,
        ssm_states, query_start_loc, slots, has_initial_state,
    )  # fmt: skip
    if reference is not None:
        return reference
    x, dt, b, c = (_dense_last(t) for t in (x, dt, b, c))
    a, d = a.contiguous(), d.contiguous()
    dt_bias = dt_bias.to(dt.dtype).contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=torch.float32, device=x.device)
    if not slots or tokens == 0:
        return out
    block_p, n_pow = _state_tile(head_dim, d_state, 2048)
    grid = (len(slots), heads, triton.cdiv(head_dim, block_p))
    _mamba2_scan_kernel[grid](
        x, dt, a, b, c, d, dt_bias, ssm_states, layout, out,
        x.stride(0), x.stride(1), dt.stride(0), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), ssm_states.stride(0),
        len(slots), heads, head_dim, d_state, heads // groups,
        float(dt_limit[0]), float(dt_limit[1]),
        BLOCK_P=block_p, NP=n_pow, DT_DTYPE=_TL_DTYPES[dt.dtype],
    )  # fmt: skip
    return out


@triton.jit
def _gated_delta_scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, layout_ptr, out_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_betan,
    stride_ss, num_seqs, HV, DK, DV, RATIO, scale,
    L2NORM: tl.constexpr, DKP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    head, vblk, start, end, slot, initial = _scan_program(layout_ptr, num_seqs)
    khead = head // RATIO
    ks = tl.arange(0, DKP)
    vs = vblk * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = ks < DK
    vmask = vs < DV
    carried = (ks * 0 + initial) != 0  # a vector: the interpreter rejects a scalar in a mask
    smask = kmask[:, None] & vmask[None, :]
    sptr = state_ptr + slot * stride_ss + (head * DK + ks)[:, None] * DV + vs[None, :]
    state = tl.load(sptr, mask=smask & carried[:, None], other=0.0)
    for t in range(start, end):
        t64 = t  # int64: the bounds are loaded from the int64 layout
        q, k, v, g, beta = _gated_delta_load(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t64, head, khead, ks, vs, kmask, vmask,
            stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn,
            stride_betan, scale, L2NORM,
        )  # fmt: skip
        state = _gated_delta_state(state, k, v, g, beta)
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + (t64 * HV + head) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)
    tl.store(sptr, state, mask=smask)


def gated_delta_chunk_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_states: torch.Tensor, query_start_loc: Sequence[int], slots: Sequence[int],
    has_initial_state: Sequence[bool], chunk_size: int = 64, use_qk_l2norm: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over prefill rows, as `ssm_reference.gated_delta_chunk_varlen`:
    `o [T, Hv, Dv]` in v's dtype, each chunk's final state left in `ssm_states[slot]`. Chunks
    of at most `SCAN_MAX_TOKENS` run the sequential Triton scan; a longer one sends the call to
    the torch chunked (WY) form."""
    tokens, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    _check_gated_delta("gated_delta_chunk_varlen", q, k, v, g, beta, ssm_states)
    layout, longest = _varlen_layout(
        query_start_loc, slots, has_initial_state, v.device, "gated_delta_chunk_varlen"
    )
    reference = _torch_form(
        longest, "gated_delta_chunk_varlen", q, k, v, g, beta, ssm_states, query_start_loc,
        slots, has_initial_state, chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
    if reference is not None:
        return reference
    q, k, v, g, beta = (_dense_last(t) for t in (q, k, v, g, beta))
    out = torch.empty((tokens, v_heads, dv), dtype=v.dtype, device=v.device)
    if not slots or tokens == 0:
        return out
    block_v, dkp = _state_tile(dv, dk, 2048)
    grid = (len(slots), v_heads, triton.cdiv(dv, block_v))
    _gated_delta_scan_kernel[grid](
        q, k, v, g, beta, ssm_states, layout, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), ssm_states.stride(0),
        len(slots), v_heads, dk, dv, v_heads // k_heads, dk**-0.5,
        L2NORM=use_qk_l2norm, DKP=dkp, BLOCK_V=block_v,
    )  # fmt: skip
    return out
