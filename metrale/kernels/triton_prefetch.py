"""L2 prefetch of weights a decode step will read soon (`KernelOps.prefetch_l2`), so their
DRAM reads overlap the latency-bound kernels in between (rotary, decode attention, its
combine) instead of waiting for the projection that needs them.

Owner: kernels.

Invariants:
- The kernel only issues `cp.async.bulk.prefetch.L2.global` hints (sm_90+) over the
  tensors' bytes, in chunks of `CHUNK` bytes (a multiple of 16; the tensors' storage is
  16-byte aligned); it reads nothing into registers and writes nothing, so no result of the
  step can change with it. A hint may be dropped by the hardware.
- In a PDL chain it issues its hints first, lets the next kernel launch, then waits for
  the previous kernel before it exits: its completion still implies its predecessor's, so
  the next kernel's wait keeps stream order.
- At most `budget` bytes are prefetched a call, whole tensors first in the order given, the
  last one possibly in part (from its start, the rows the GEMV's first programs read).
- Graph-capturable: no host sync, no allocation; the launch depends only on the tensors'
  addresses and sizes.
- Experimental: off unless `METRALE_L2_PREFETCH=1` (`kernels_for`) until the H200 A/B
  (`tools/gpu_session.sh prefetch`) says it pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import gdc_launch_dependents, gdc_wait, pdl_options

#: Bytes one prefetch instruction covers.
CHUNK = 4096
#: Chunks one program issues (one per thread of its 4 warps).
CHUNKS_PER_PROGRAM = 128
#: Bytes prefetched a call at most (about half the H100/H200 L2 of 50 MiB).
DEFAULT_BUDGET = 24 << 20
#: Most rows of a forward that prefetches: decode batches whose step is bound by reading
#: the weights (the GEMV's rows; more rows leave the call a no-op).
MAX_ROWS = 8


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):  # fmt: skip
    """Grid `(cdiv(nbytes, CHUNK * BLOCK),)`: thread i of program p hints chunk
    `p * BLOCK + i` of the `nbytes` at address `base`."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    base = base.to(tl.int64)
    size = tl.maximum(tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base + offs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def prefetch_l2(
    rows: int, tensors: list[torch.Tensor], budget: int = DEFAULT_BUDGET, *, pdl: bool = False
) -> None:
    """`KernelOps.prefetch_l2`: for a forward of `rows` rows (at most `MAX_ROWS`, else
    nothing), hint the first `budget` bytes of `tensors` (in order) into L2, one launch per
    tensor prefetched. Contiguous CUDA tensors only."""
    if rows > MAX_ROWS:
        return
    left = budget
    for t in tensors:
        if left <= 0:
            break
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError("prefetch_l2 takes contiguous CUDA tensors")
        nbytes = min(t.numel() * t.element_size(), left) // 16 * 16
        if nbytes == 0:
            continue
        left -= nbytes
        grid = (triton.cdiv(nbytes, CHUNK * CHUNKS_PER_PROGRAM),)
        _l2_prefetch_kernel[grid](
            t.data_ptr(), nbytes, CHUNK=CHUNK, BLOCK=CHUNKS_PER_PROGRAM, PDL=pdl, num_warps=4,
            **pdl_options(pdl),
        )  # fmt: skip
