"""The Triton GEMV's launch configuration (`triton_gemv`): `GemvConfig`, the `default_config`
heuristic and the `candidate_configs` `tools/bench_gemv.py` times on a device.

Owner: kernels. `triton_gemv` re-exports every name here.

Invariants:
- A config depends only on shapes, dtype, alignment and the SM count (so a captured CUDA
  graph always launches the same kernels), and fits M rows of float32 accumulators within
  the per-thread register budget (`GemvConfig.fits`).

Config heuristic (`default_config`, for H100/H200-class parts; only shapes, dtype, alignment and
the SM count go in):
- a tile row is 1 KiB of W: `BLOCK_K` = 512 elements for bf16/fp16, 256 for fp32, capped at
  K's next power of two; `BLOCK_N` = 16 rows when M == 1, else 8; 4 warps. Every thread then
  holds at most 128 float32 accumulator values (`M * BLOCK_N * BLOCK_K / 128 <= 128`);
- when M > 4, or when the loads cannot vectorise (K, a row stride or a base address not a
  multiple of 16 elements / bytes: scalar loads need more registers for addresses), the tile
  is halved to 8 rows of 512 B. With that, every M and dtype compiles for sm_90 without
  spills for aligned rows, and with at most two spilled scalars for unaligned ones (checked
  with ptxas);
- a 3-stage cp.async pipeline at M == 1 (two W tiles in flight per program, 34 KiB of shared
  memory), 4 stages for M > 1, so bandwidth does not hinge on how many programs fit on an SM;
- no split-K by default (measured on the H200: each split shape ran faster unsplit; the
  `split_k=0` config still picks the split described by `_split_for`, for the benchmark).
  Qwen3-8B bf16 at M == 1: qkv 384 programs, o_proj 256, gate_up 1536, down 256, lm_head
  9496; at M == 1 the projections reach 80-109% of the H200's copy bandwidth (cuBLAS 63-100%).
`candidate_configs` lists the variations `tools/bench_gemv.py` times on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

#: Most rows of x one call takes (each row is a separate accumulator in every program).
MAX_M = 8
#: Float32 accumulator values one thread may hold (`M * BLOCK_N * BLOCK_K / threads`).
_ACC_BUDGET = 128


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of one GEMV (`block_n`, `block_k` powers of two). `split_k=0` means
    "the heuristic's split for these blocks"; `num_stages=1` is a plain loop, more stages a
    software pipeline through shared memory. At launch `block_k` is capped at K's next power
    of two and `split_k` at K's number of tiles."""

    block_n: int = 16
    block_k: int = 512
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3

    def describe(self) -> str:
        return (
            f"n{self.block_n}_k{self.block_k}_s{self.split_k}_w{self.num_warps}_st{self.num_stages}"
        )

    def fits(self, m: int) -> bool:
        """Whether M rows of accumulators stay within the per-thread register budget."""
        return m * self.block_n * self.block_k <= _ACC_BUDGET * 32 * self.num_warps


def _split_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 2 * sms and k_tiles >= 4 * (2 * split):
        split *= 2
    return split


def _resolve(config: GemvConfig, n: int, k: int, dtype: torch.dtype, sms: int) -> GemvConfig:
    """`config` made concrete for one shape: `block_k` capped (but at least one 16-byte
    vector per thread of a warp), `split_k` chosen if 0 and capped at K's tiles."""
    block_k = max(16 // dtype.itemsize, min(config.block_k, triton.next_power_of_2(max(k, 1))))
    split = config.split_k or _split_for(n, k, config.block_n, block_k, sms)
    split = max(1, min(split, triton.cdiv(k, block_k)))
    return replace(config, block_k=block_k, split_k=split)


@functools.lru_cache(maxsize=1024)
def default_config(
    m: int, n: int, k: int, dtype: torch.dtype, sms: int = 132, aligned: bool = True
) -> GemvConfig:
    """The heuristic described in the module docstring, resolved for the shape. `aligned`:
    whether the loads vectorise (see `_aligned`)."""
    row_bytes = 1024 if m <= 4 and aligned else 512
    block_n = 16 if m == 1 and aligned else 8
    # No split-K: on the H200 every split shape ran slower unsplit-faster (o_proj 11.96 ->
    # 10.45 us, down 27.12 -> 25.35 us at M = 1; bench/records/*-gemv-*.json), the second
    # (reduce) kernel costing more than the extra programs gained. M = 2 pipelines 4 stages.
    stages = 4 if m > 1 else 3
    config = GemvConfig(block_n, row_bytes // dtype.itemsize, split_k=1, num_stages=stages)
    return _resolve(config, n, k, dtype, sms)


def candidate_configs(
    m: int, n: int, k: int, dtype: torch.dtype, sms: int = 132
) -> list[GemvConfig]:
    """`default_config` first, then variations of it worth timing on a new device (stages,
    tile height/width, warps, split), resolved for the shape, deduplicated, and only those
    within the register budget for M."""
    base = default_config(m, n, k, dtype, sms)
    free = replace(base, split_k=0)
    raw = [
        base,
        replace(base, num_stages=1),
        replace(base, num_stages=2),
        replace(base, num_stages=4),
        replace(free, block_n=base.block_n * 2),
        replace(free, block_n=max(1, base.block_n // 2)),
        replace(free, block_n=base.block_n * 2, num_warps=8),
        replace(free, block_n=max(1, base.block_n // 2), block_k=base.block_k * 2),
        replace(base, split_k=1),
        replace(base, split_k=2 * base.split_k),
    ]
    out: list[GemvConfig] = []
    for config in raw:
        resolved = _resolve(config, n, k, dtype, sms)
        if resolved.fits(m) and resolved not in out:
            out.append(resolved)
    return out
