"""Sweep the paged decode-attention kernel's launch settings at one serving shape: context
splits x (BLOCK_N, num_warps, num_stages), each timed over back-to-back launches with CUDA
events, against the library's own choice; prints GB/s of K/V read (the kernel is a stream of
the cache) and checks every setting's output against the default one.

Why: at C=128 on the H200 (Qwen3-8B shape, context ~640) decode attention is ~40% of a
decode step (3.4 of 8.4 ms, tools/graph_step_time.py --rows 128 --context 640).

Usage (GPU): PYTHONPATH=. python3 tools/sweep_decode_attention.py [--rows 128] [--context 640]
    [--kv-heads 8] [--group 4] [--head-dim 128] [--out result.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from metrale.kernels import triton_decode
from metrale.kernels.triton_decode import decode_attention, decode_num_splits
from tools.bench_sampler import time_ms

CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (64, 8, 3), (128, 8, 2),
           (128, 8, 3), (128, 4, 2)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    rows, ctx, kvh, d, bs = args.rows, args.context, args.kv_heads, args.head_dim, args.block_size
    blocks_per_seq = (ctx + bs - 1) // bs
    total_blocks = rows * blocks_per_seq + 1
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn((total_blocks, bs, kvh, d), generator=gen, device=device, dtype=dtype)
    v = torch.randn((total_blocks, bs, kvh, d), generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(total_blocks - 1, generator=gen, device=device) + 1  # scattered blocks
    tables = perm[: rows * blocks_per_seq].view(rows, blocks_per_seq).to(torch.int32)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=device)
    q = torch.randn((rows, kvh * args.group, d), generator=gen, device=device, dtype=dtype)
    scale = d**-0.5
    kv_bytes = 2 * rows * ctx * kvh * d * 2
    default_splits = decode_num_splits(rows, kvh, blocks_per_seq, bs, device)
    reference = decode_attention(q, k, v, lens, tables, scale)
    base = triton_decode._decode_config
    results = []
    for splits, config in itertools.product((1, 2, 4), CONFIGS):

        def pick(
            dtype_: torch.dtype, head_dim: int, splits_: int = 2,
            cfg: tuple[int, int, int] = config,
        ) -> tuple[int, int, int]:  # fmt: skip
            return cfg

        triton_decode._decode_config = pick  # this process only: the sweep's setting
        try:
            out = torch.empty_like(q)

            def run(s: int = splits, o: torch.Tensor = out) -> None:
                decode_attention(q, k, v, lens, tables, scale, out=o, num_splits=s)

            ms = time_ms(run, iters=50, warmup=5)
            err = (out.float() - reference.float()).abs().max().item()
        except Exception as exc:  # a setting that does not compile is a result too
            results.append({"splits": splits, "config": config, "error": str(exc)[:200]})
            print(f"splits {splits} {config}: {type(exc).__name__}", flush=True)
            continue
        finally:
            triton_decode._decode_config = base
        row = {"splits": splits, "config": config, "ms": ms, "gb_s": kv_bytes / ms / 1e6,
               "max_abs_diff": err}  # fmt: skip
        results.append(row)
        print(f"splits {splits} BLOCK_N/warps/stages {config}: {ms:.4f} ms "
              f"{row['gb_s']:.0f} GB/s  diff {err:.2e}", flush=True)  # fmt: skip
    default_ms = time_ms(lambda: decode_attention(q, k, v, lens, tables, scale), iters=50, warmup=5)
    print(f"library default (splits {default_splits}, {base(dtype, d, default_splits)}): {default_ms:.4f} ms "
          f"{kv_bytes / default_ms / 1e6:.0f} GB/s")  # fmt: skip
    best = min((r for r in results if "ms" in r), key=lambda r: r["ms"])
    print(f"best: {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": vars(args), "default_ms": default_ms, "results": results}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
