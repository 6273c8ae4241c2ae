"""Shared pieces of the Triton kernels: device queries, split constants, programmatic
dependent launch (PDL) helpers, the device helpers (`_dot`, `online_softmax_start`,
`_attend_tile`) both the decode and the prefill kernels inline, the float8 KV helpers
(`kv_scale_args`, `_quantize_kv`), and the activations the MoE and conv kernels fuse
(`ACTIVATIONS`, `_activate`).

Owner: kernels. See `triton_attention` for the invariants the kernels keep together.

PDL (sm_90+): a kernel launched with `pdl_options(True)` may start while the kernel before it
on the stream is finishing; it must call `gdc_wait()` before touching any global memory (its
inputs may still be being written, its outputs still being read), and may call
`gdc_launch_dependents()` to let the next kernel launch early in turn. `gdc_wait` returns
only once the previous kernel has completed and its writes are visible, so a chain of PDL
kernels keeps stream order for every memory access.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from metrale.kernels.reference import FP8_KV_MAX

__all__ = ["gdc_launch_dependents", "gdc_wait", "pdl_enter", "pdl_options", "pdl_supported"]

_LOG2E = 1.4426950408889634

#: Context capacity per decode split (tokens): the launch's static split count is at most
#: `block-table capacity / MIN_SPLIT_TOKENS`, so the reduction stays small. At run time the
#: tiles of a row are dealt over all splits (one tile each at least): a short context then
#: runs its few tiles side by side instead of in one program (on the H200, 4 tiles in one
#: program made batch-1 decode attention take 9.6 us per layer).
MIN_SPLIT_TOKENS = 256
#: Most splits of one decode row (partials cost `splits * head_dim * 4` bytes per head).
MAX_SPLITS = 64


#: Activation name -> `_activate`'s constexpr code (the MoE and causal-conv kernels').
ACTIVATIONS: dict[str, int] = {
    "silu": 0,
    "swish": 0,
    "relu": 1,
    "relu2": 2,
    "gelu_pytorch_tanh": 3,
    "gelu": 4,
}
#: `_activate`'s code for no activation (the identity).
NO_ACTIVATION = 5

# tl.constexpr: Triton refuses plain float globals in jit code.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can use programmatic dependent launch (sm_90+, compiled)."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_options(pdl: bool) -> dict[str, bool]:
    """Launch keywords for a kernel call: `launch_pdl` only when on (the interpreter and older
    parts never see it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's opening (a no-op unless PDL): wait until the previous kernel's writes are
    visible, then let the next kernel launch early. Kernels that can overlap more (GEMV) call
    the two steps apart instead."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a fixed small number on the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


# -------------------------------------------------------------------------------------------
# Shared device helpers
# -------------------------------------------------------------------------------------------


@triton.jit
def _activate(g, ACT: tl.constexpr):
    """The activation of float32 `g` (codes of `ACTIVATIONS`, `NO_ACTIVATION`), in float32."""
    if ACT == 0:
        out = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        out = tl.maximum(g, 0.0)
    elif ACT == 2:
        r = tl.maximum(g, 0.0)
        out = r * r
    elif ACT == 3:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        out = 0.5 * g * (1.0 + tanh)
    elif ACT == 4:
        out = 0.5 * g * (1.0 + tl.math.erf(g * _INV_SQRT_2))
    else:
        out = g
    return out


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """`a @ b` accumulated in float32. UPCAST: operands as float32 (the CPU interpreter
    mis-computes bf16 dots); IEEE: exact float32 products (no tf32) for float32 inputs."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_softmax_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax's `(m_i, l_i, acc)` before the first tile, for ROWS query rows."""
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    rows,
    kv,
    tile,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One online-softmax step over the context tokens `tile*BLOCK_N ..` of one sequence.

    `rows` = `(q, q_pos, row_ok, offs_d, d_mask, scale_log2, window)`: rows of `q` `[M, D]`
    (head-dim lanes `offs_d`) sit at positions `q_pos` `[M]`; a row attends to keys at positions
    `<= q_pos` (and `> q_pos - window` with a window). `kv` = `(k_ptr, v_ptr, table_row_ptr,
    seq_len, max_blocks, kv_head, stride_cb, stride_cs, stride_ch)`: the sequence's paged K/V
    for one KV head. MASKED=False promises every key of the tile is visible to every row
    (interior causal tiles), which skips the masking. (Tuples keep each call site one line;
    constexprs stay separate arguments: inside a tuple they would reach the helper as values.)
    """
    q, q_pos, row_ok, offs_d, d_mask, scale_log2, window = rows
    k_ptr, v_ptr, table_row_ptr, seq_len, max_blocks, kv_head, stride_cb, stride_cs, stride_ch = kv
    k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = k_pos // BLOCK_SIZE
    in_ctx = (k_pos < seq_len) & (blk < max_blocks)
    page = tl.load(table_row_ptr + blk, mask=in_ctx, other=0)
    offs = (
        page.to(tl.int64) * stride_cb
        + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        + kv_head.to(tl.int64) * stride_ch
    )
    kv_mask = in_ctx[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k.to(q.dtype)), UPCAST, IEEE) * scale_log2
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :] & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf: shift by 0 instead (no NaN).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
    return acc, m_new, l_i


# -------------------------------------------------------------------------------------------
# KV write
# -------------------------------------------------------------------------------------------


def attention_strides(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor
) -> tuple[int, ...]:
    """The strides the decode and prefill kernels take as one tuple argument (`strides`), in
    their order: q (token, head), the caches (block, slot, head; V's equal K's), the block table
    (row), out (token, head)."""
    return (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
    )  # fmt: skip


def specialisation(q: torch.Tensor, sliding_window: int | None, kv_fp8: bool) -> dict[str, bool]:
    """The constexpr flags both attention kernels specialise on: a sliding window, dots
    upcast to float32 (under the interpreter), IEEE dots (float32 queries), float8 K/V."""
    return {
        "USE_WINDOW": sliding_window is not None,
        "UPCAST": interpreting(),
        "IEEE": q.dtype == torch.float32,
        "KV_FP8": kv_fp8,
    }


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must have the same shape and strides")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K cache {k_cache.dtype} and V cache {v_cache.dtype} differ in dtype")
    if k_cache.stride(-1) != 1:
        raise ValueError("KV cache rows must be contiguous in head_dim")


def kv_scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`(k_scale, v_scale, KV_FP8)` for a kernel launch: the `[1]` float32 scales of a float8
    cache (required; `reference.quantize_kv`), or placeholders (never read) and False."""
    if k_cache.dtype not in FP8_KV_MAX:
        return k_cache, k_cache, False
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.dtype != torch.float32 or t.numel() != 1 or t.device != k_cache.device:
            raise ValueError(f"{name} must be one float32 element on {k_cache.device}")
    return k_scale, v_scale, True


@triton.jit
def _quantize_kv(x, scale, KV_FP8: tl.constexpr, dst_ty: tl.constexpr):
    """`reference.quantize_kv` of float32 `x` for a cache of `dst_ty`: `x / scale` (IEEE
    division), saturated to +-448, cast (round to nearest even); a plain cast without
    KV_FP8."""
    if KV_FP8:
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        out = y.to(dst_ty)
    else:
        out = x.to(dst_ty)
    return out


# -------------------------------------------------------------------------------------------
# Paged decode attention (one query token per row), split along the context
# -------------------------------------------------------------------------------------------
