"""Multi-LoRA on CUDA: the gather form of `reference.lora_gather_add` as two Triton kernels,
shrink (`x @ A[slot].T * scale[slot]`, float32) then expand (`y += xa @ B[slot].T`), each
token row reading its adapter through its slot.

Owner: kernels. `lora_gather_add` is the CUDA entry of `KernelOps.lora_gather_add`.

Invariants:
- Computes `reference.lora_gather_add`: rows of slot -1 are neither read nor written, the
  rank dimension is padded to a power of two and masked, accumulation is float32.
- No host read of the slot tensor: the launch depends only on shapes, so the op can be
  captured in a CUDA graph with the slot tensor as a graph input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink(
    x_ptr, a_ptr, slots_ptr, scales_ptr, out_ptr,
    K, R, stride_x, stride_as, stride_ar,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = (k < K) & ((k * 0 + slot) >= 0)  # base rows (slot -1) read nothing
        xv = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(
            a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    scale = tl.load(scales_ptr + s)
    tl.store(out_ptr + t * BLOCK_R + r, acc * scale, mask=r_mask)


@triton.jit
def _lora_expand(
    xa_ptr, b_ptr, slots_ptr, y_ptr,
    N, R, stride_y, stride_bs, stride_br,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (n < N) & ((n * 0 + slot) >= 0)  # base rows (slot -1) are not written
    xa = tl.load(xa_ptr + t * BLOCK_R + r, mask=r_mask, other=0.0)
    bv = tl.load(
        b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(bv * xa[:, None], axis=0)
    ptr = y_ptr + t * stride_y + n
    yv = tl.load(ptr, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(ptr, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def lora_gather_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """`reference.lora_gather_add` (see there) by the shrink and expand kernels."""
    tokens = x.shape[0]
    if tokens == 0:
        return
    fan_in, rank, fan_out = x.shape[1], a.shape[1], y.shape[1]
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b_t.stride(2) != 1:
        raise ValueError("lora_gather_add needs unit-stride rows (x, y, a, b_t)")
    block_r = max(16, triton.next_power_of_2(rank))
    xa = torch.empty(tokens, block_r, dtype=torch.float32, device=x.device)
    _lora_shrink[(tokens,)](
        x, a, token_slots, scales, xa, fan_in, rank, x.stride(0), a.stride(0), a.stride(1),
        BLOCK_R=block_r, BLOCK_K=64 if block_r >= 64 else 128,
    )  # fmt: skip
    block_n = 128
    _lora_expand[(tokens, triton.cdiv(fan_out, block_n))](
        xa, b_t, token_slots, y, fan_out, rank, y.stride(0), b_t.stride(0), b_t.stride(1),
        BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
