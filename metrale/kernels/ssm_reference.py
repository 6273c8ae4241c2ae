"""Torch references of the recurrent-layer and mixture-of-experts ops: causal conv1d (prefill
and decode), the Mamba-2 SSD scan (chunked) and state update (one step), the gated delta rule
(chunked and one step), and the mixture-of-experts softmax routing and grouped expert
computation. They are the CPU path and define
what the future Triton kernels must compute.

Owner: kernels.

Invariants:
- The varlen ops take a batch's prefill rows flattened sequence-major (`query_start_loc`) and
  read and write each sequence's state in pool slot `slots[b]`, in place. A sequence whose
  `has_initial_state[b]` is False starts from zeros whatever its slot holds.
- Chunked forms start from the carried state, so splitting a prompt into chunks anywhere gives
  the state of one whole pass up to rounding (the chunk boundaries are local to each call).
- Recurrent (SSM) state is float32; the math of both forms runs in float32.
- The one-step forms follow transformers' torch fallbacks operation by operation, so decode
  agrees with transformers' decode to rounding; the chunked forms compute the same functions
  as `torch_chunk_gated_delta_rule` and the Mamba-2 `torch_forward` chunk scan.
- Nothing loops over tokens in Python: loops are over sequences, chunks or experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def apply_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    if activation == "relu2":
        return torch.square(F.relu(x))
    if activation == "relu":
        return F.relu(x)
    if activation in ("gelu", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh" if activation == "gelu_pytorch_tanh" else "none")
    raise ValueError(f"unsupported activation '{activation}'")


# --------------------------------------------------------------------------------------------
# Causal depthwise conv1d with a carried window
# --------------------------------------------------------------------------------------------


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
    activation: str | None,
) -> torch.Tensor:
    """Causal conv over each sequence's rows `[T, C]`, continuing from its window in
    `conv_states[slot]` (`[C, K]`, oldest first) and leaving the last K inputs there."""
    out = torch.empty_like(x)
    channels, width = weight.shape
    for b, slot in enumerate(slots):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        length = end - start
        rows = x[start:end].t()  # [C, L]
        if has_initial_state[b]:
            prev = conv_states[slot].to(rows.dtype)
        else:
            prev = rows.new_zeros(channels, width)
        full = torch.cat([prev, rows], dim=-1)  # [C, K + L]
        y = F.conv1d(full.to(weight.dtype).unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)
        conv_states[slot].copy_(full[:, -width:])
        out[start:end] = apply_activation(y[0, :, -length:], activation).t().to(x.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """One new input per row `[n, C]`: shift it into `conv_states[slots[i]]` and convolve the
    window (transformers' `causal_conv1d_update`)."""
    channels = weight.shape[0]
    window = torch.cat([conv_states.index_select(0, slots)[:, :, 1:], x.unsqueeze(-1)], dim=-1)
    conv_states.index_copy_(0, slots, window.to(conv_states.dtype))
    y = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=channels)
    return apply_activation(y[:, :, -1], activation).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Mamba-2 (SSD)
# --------------------------------------------------------------------------------------------


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """`out[..., i, j] = a[..., j+1] + ... + a[..., i]` for j <= i, -inf above the diagonal.

    Summed per pair (masked cumulative sum), not as a difference of prefix sums, so long
    chunks do not lose precision."""
    q = a.shape[-1]
    expanded = a.unsqueeze(-1).expand(*a.shape, q)  # [..., k, j] = a[k]
    strict = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(expanded.masked_fill(~strict, 0.0), dim=-2)
    lower = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one sequence, float32.

    `x [L, H, P]`, discretised `dt [L, H]`, `a [H]` (negative), `b`/`c [L, H, N]` (groups
    already expanded to heads), `state [H, P, N]` entering the sequence. Returns `y [L, H, P]`
    (without the D skip) and the state after the last token.
    """
    length, heads, head_dim = x.shape
    pad = (-length) % chunk_size
    xdt = x * dt.unsqueeze(-1)
    adt = dt * a  # [L, H] log decay per step
    if pad:
        xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad))
        adt = F.pad(adt, (0, 0, 0, pad))
        b = F.pad(b, (0, 0, 0, 0, 0, pad))
        c = F.pad(c, (0, 0, 0, 0, 0, pad))
    nc = (length + pad) // chunk_size
    xdt = xdt.view(nc, chunk_size, heads, head_dim)
    b = b.reshape(nc, chunk_size, heads, -1)
    c = c.reshape(nc, chunk_size, heads, -1)
    adt = adt.view(nc, chunk_size, heads).permute(0, 2, 1)  # [nc, H, Q]
    cum = torch.cumsum(adt, dim=-1)  # [nc, H, Q]
    decay = torch.exp(_segsum(adt))  # [nc, H, Q(i), Q(j)]
    # Within each chunk: causal "attention" of C against B, decayed.
    scores = torch.einsum("cihn,cjhn->chij", c, b) * decay
    y = torch.einsum("chij,cjhp->cihp", scores, xdt)
    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(cum[:, :, -1:] - cum)  # [nc, H, Q]
    contrib = torch.einsum("cjhn,chj,cjhp->chpn", b, to_end, xdt)
    chunk_decay = torch.exp(cum[:, :, -1])  # [nc, H]
    entering = []
    for i in range(nc):
        entering.append(state)
        state = state * chunk_decay[i][:, None, None] + contrib[i]
    states_in = torch.stack(entering)  # [nc, H, P, N]
    # Reading the state that entered the chunk, decayed to each position.
    y = (
        y
        + torch.einsum("cihn,chpn->cihp", c, states_in) * torch.exp(cum).permute(0, 2, 1)[..., None]
    )
    return y.reshape(nc * chunk_size, heads, head_dim)[:length], state


def mamba2_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    chunk_size: int,
    ssm_states: torch.Tensor,
    query_start_loc: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
) -> torch.Tensor:
    """Mamba-2 over prefill rows: `x [T, H, P]`, raw `dt [T, H]`, `b`/`c [T, G, N]`.

    `dt = clamp(softplus(dt + dt_bias), *dt_limit)`; returns float32 `y [T, H, P]` including
    `D * x`, and leaves each sequence's final state in `ssm_states[slot]`.
    """
    heads = x.shape[1]
    groups = b.shape[1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    xf = x.float()
    bh = b.float().repeat_interleave(heads // groups, dim=1)
    ch = c.float().repeat_interleave(heads // groups, dim=1)
    af = a.float()
    y = torch.empty_like(xf)
    for i, slot in enumerate(slots):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        init = ssm_states[slot] if has_initial_state[i] else torch.zeros_like(ssm_states[slot])
        ys, final = ssd_chunk_scan(
            xf[start:end], dt[start:end], af, bh[start:end], ch[start:end], init.float(),
            chunk_size,
        )  # fmt: skip
        y[start:end] = ys
        ssm_states[slot].copy_(final)
    return y + d.float()[:, None] * xf


def mamba2_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One Mamba-2 step per row (transformers' selective state update, no dt clamp):
    `x [n, H, P]`, raw `dt [n, H]`, `b`/`c [n, G, N]`; returns `y [n, H, P]` in x's dtype."""
    n, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    d_a = torch.exp(dt.float() * a.float())  # [n, H]
    bh = b.repeat_interleave(heads // groups, dim=1)  # [n, H, N]
    ch = c.repeat_interleave(heads // groups, dim=1)
    d_bx = (dt[:, :, None, None] * bh[:, :, None, :]) * x[..., None]  # [n, H, P, N]
    state = ssm_states.index_select(0, slots)
    state = state * d_a[:, :, None, None] + d_bx.float()
    ssm_states.index_copy_(0, slots, state)
    out = torch.bmm(
        state.to(ch.dtype).view(n * heads, head_dim, d_state),
        ch.reshape(n * heads, d_state, 1),
    ).view(n, heads, head_dim)
    return (out + x * d[:, None]).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Gated delta rule (Qwen3-Next linear attention)
# --------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gdn_prepare(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 q (l2-normalised if asked, scaled by `d_k ** -0.5`) and k, expanded to the
    value heads (each key head serves `Hv / Hk` consecutive value heads)."""
    ratio = num_v_heads // q.shape[-2]
    q, k = q.float(), k.float()
    if ratio > 1:
        q = q.repeat_interleave(ratio, dim=-2)
        k = k.repeat_interleave(ratio, dim=-2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def gated_delta_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of one sequence in chunked (WY) form, float32.

    `q`/`k [L, H, Dk]` (prepared), `v [L, H, Dv]`, log decay `g [L, H]`, `beta [L, H]`,
    `state [H, Dk, Dv]`. Returns `o [L, H, Dv]` and the state after the last token.
    """
    length = q.shape[0]
    pad = (-length) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))  # [H, L', D]
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(0, 1) for t in (g, beta))  # [H, L']
    heads = q.shape[0]
    nc = (length + pad) // chunk_size
    q, k, v = (t.reshape(heads, nc, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(heads, nc, chunk_size) for t in (g, beta))
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    cum = torch.cumsum(g, dim=-1)  # [H, nc, Q]
    lower = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    decay = torch.exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")))
    # (I + strictly-lower(beta K K^T * decay)) U = V_beta, and the same for the decayed keys.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # causal, diagonal included
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()  # [H, nc]
    out = torch.empty_like(v)
    for i in range(nc):
        v_new = u[:, i] - w[:, i] @ state  # [H, Q, Dv]
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, nc * chunk_size, -1)[:, :length].transpose(0, 1)
    return out, state


def gated_delta_chunk_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Gated delta rule over prefill rows: `q`/`k [T, Hk, Dk]`, `v [T, Hv, Dv]`, log decay
    `g [T, Hv]`, `beta [T, Hv]`; returns `o [T, Hv, Dv]` in v's dtype and leaves each
    sequence's final state `[Hv, Dk, Dv]` in `ssm_states[slot]`."""
    qf, kf = _gdn_prepare(q, k, v.shape[1], use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty_like(vf)
    for i, slot in enumerate(slots):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        init = ssm_states[slot] if has_initial_state[i] else torch.zeros_like(ssm_states[slot])
        o, final = gated_delta_chunk(
            qf[start:end], kf[start:end], vf[start:end], gf[start:end], bf[start:end],
            init.float(), chunk_size,
        )  # fmt: skip
        out[start:end] = o
        ssm_states[slot].copy_(final)
    return out.to(v.dtype)


def gated_delta_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One gated-delta step per row (transformers' recurrent form): `q`/`k [n, Hk, Dk]`,
    `v [n, Hv, Dv]`, `g`/`beta [n, Hv]`; returns `o [n, Hv, Dv]` in v's dtype."""
    qf, kf = _gdn_prepare(q, k, v.shape[1], use_qk_l2norm)
    vf = v.float()
    state = ssm_states.index_select(0, slots)  # [n, H, Dk, Dv]
    state = state * g.float().exp()[..., None, None]
    memory = (state * kf.unsqueeze(-1)).sum(dim=-2)  # [n, H, Dv]
    delta = (vf - memory) * beta.float().unsqueeze(-1)
    state = state + kf.unsqueeze(-1) * delta.unsqueeze(-2)
    ssm_states.index_copy_(0, slots, state)
    return (state * qf.unsqueeze(-1)).sum(dim=-2).to(v.dtype)


# --------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------


def moe_softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing from router logits `[T, E]`: softmax over all experts in float32, the
    top k (descending), divided by their sum when `renormalize`; `(ids int64 [T, k], weights
    [T, k] in out_dtype)`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(out_dtype)


def moe_softmax_experts(
    x: torch.Tensor,
    logits: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype,
    gated: bool,
    activation: str,
) -> torch.Tensor:
    """A softmax-routed MoE layer's experts from its router `logits [T, E]`:
    `moe_softmax_topk` then `moe_experts` (one op so a device can fuse the routing in)."""
    ids, weights = moe_softmax_topk(logits, top_k, renormalize, weights_dtype)
    return moe_experts(x, w_in, w_out, ids, weights, gated, activation)


def moe_experts(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gated: bool,
    activation: str,
) -> torch.Tensor:
    """Grouped expert computation: `x [T, H]`, `w_in [E, R, H]` (R = 2I gate|up when gated,
    else I), `w_out [E, H, I]`, routing `topk_ids`/`topk_weights [T, k]`.

    Assignments are sorted by expert so each expert runs one matmul over all its tokens; the
    weighted outputs are scattered back with one `index_add_`.
    """
    tokens, top_k = topk_ids.shape
    num_experts = w_in.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    grouped = x.index_select(0, token_of)
    outs = []
    for e, rows in enumerate(grouped.split(counts)):
        if rows.shape[0] == 0:
            continue
        h = F.linear(rows, w_in[e])
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = apply_activation(gate, activation) * up
        else:
            h = apply_activation(h, activation)
        outs.append(F.linear(h, w_out[e]))
    weights = topk_weights.reshape(-1).index_select(0, order)
    expert_out = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
    expert_out = expert_out * weights.unsqueeze(-1)
    out = torch.zeros((tokens, x.shape[1]), dtype=expert_out.dtype, device=x.device)
    out.index_add_(0, token_of, expert_out)
    return out.to(x.dtype)
