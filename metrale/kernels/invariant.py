"""Batch-invariant CPU ops: a row's result depends only on that row's inputs, never on which
other rows share the batch, how the prompt was chunked, or whether its prefix came from the
cache. `EngineConfig.batch_invariant` selects them (`kernels_for(..., batch_invariant=True)`).

Owner: kernels.

Invariants:
- `linear` / `silu_mul_linear` run the GEMM on fixed tiles of `TILE` rows (the last one
  zero-padded), so every row is computed by the same kernel on the same shape whatever the
  batch's row count.
- `paged_attention` computes each query row alone over exactly the keys it sees (positions
  `0..p`, or the sliding window), with reductions whose length depends only on `p`: a token's
  attention output is the same in a decode batch, in any prefill chunk, and after a prefix
  hit. Every other op of the reference set is already row-local (norms, rotary, KV writes,
  the sampler's per-row reductions).
- Not covered: MoE expert GEMMs (rows grouped per expert) and the recurrent layers' chunked
  scans; `kernels_for` refuses the mode on CUDA (its kernels split reductions by batch
  shape).
- Slower than the reference (a Python loop over query rows): an exactness mode for gates and
  audits, not for throughput.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels.metadata import AttentionMetadata
from metrale.kernels.reference import _gather, silu_and_mul

#: Rows per GEMM call.
TILE = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, computed `TILE` rows at a time (see the module invariants)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = (-m) % TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    for i in range(0, rows.shape[0], TILE):
        out[i : i + TILE] = F.linear(rows[i : i + TILE], weight, bias)
    return out[:m].reshape(*lead, weight.shape[0])


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return linear(silu_and_mul(gate_up), weight, bias)


def _attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row `[Hq, D]` over its keys `[L, Hk, D]`: elementwise products summed over D,
    softmax over L, probabilities times values summed over L."""
    hk, d = k.shape[1], k.shape[2]
    group = q.shape[0] // hk
    qh = q.reshape(hk, group, 1, d)
    kh = k.permute(1, 0, 2).unsqueeze(1).contiguous()  # [Hk, 1, L, D]
    vh = v.permute(1, 0, 2).unsqueeze(1).contiguous()
    scores = (qh * kh).sum(-1) * scale  # [Hk, g, L]
    probs = torch.softmax(scores, dim=-1)
    return (probs.unsqueeze(-1) * vh).sum(-2).reshape(hk * group, d)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of query rows `[T, Hq, D]` over paged K/V, one row at a time."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
    nd, ql = meta.num_decode, meta.decode_query_len
    lens = meta.seq_lens_host or meta.seq_lens.tolist()
    host_k = host_v = None
    if meta.host_kv is not None:  # high-speed swap's host blocks
        host_k, host_v = meta.host_kv.layer_tensors(k_cache)
    for b in range(meta.num_seqs):
        if b < nd:
            start, end = b * ql, (b + 1) * ql
        else:
            start, end = starts[b], starts[b + 1]
        length = lens[b]
        k = _gather(k_cache, meta.block_tables[b], length, host_k).to(q.dtype)
        v = _gather(v_cache, meta.block_tables[b], length, host_v).to(q.dtype)
        first = length - (end - start)
        for j in range(end - start):
            p = first + j
            lo = max(0, p - sliding_window + 1) if sliding_window is not None else 0
            out[start + j] = _attend_row(q[start + j], k[lo : p + 1], v[lo : p + 1], scale)
    return out
