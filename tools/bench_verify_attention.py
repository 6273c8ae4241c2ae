"""Decode attention with Q query rows per sequence (speculative verify, Q = k + 1) against
plain decode (Q = 1) on Qwen3-8B's attention shape: 32 query heads, 8 KV heads, head_dim 128,
bf16, KV block size 16.

Usage (CUDA only; well under a minute on an H200, Triton compilation included):
    PYTHONPATH=. python tools/bench_verify_attention.py --out $OUT/verify_attention.json
    PYTHONPATH=. python tools/bench_verify_attention.py --verify-warps 4   # 4 warps from 32 rows

Method:
- Each case is `triton_attention.decode_attention` (attention + split combine, the split
  count the engine would pick) timed as a CUDA-graph replay of `--calls` back-to-back calls,
  median of `--replays` replays divided by the number of calls, in microseconds. No
  torch.compile. The calls rotate over enough copies of the KV cache (>= 256 MiB together)
  that no call finds its K/V in L2.
- Every sequence has `--context` cached tokens (the Q verify tokens included) in shuffled
  blocks. `GB/s` = K and V bytes read (B x context x 8 heads x 128 x 2 bytes x 2) / time.
- Each Q > 1 case is checked first against the torch reference (relative error, reported).
- `--verify-warps` overrides the warps of Q > 1 launches with 32+ rows per program (the
  default is `triton_decode._verify_config`), to compare the candidates.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from metrale.kernels import reference, triton_decode
from metrale.kernels import triton_attention as ta
from metrale.kernels.metadata import AttentionMetadata

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _case(batch: int, context: int, copies: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = 1 + batch * blocks_per_seq
    tables = (torch.randperm(num_blocks - 1, generator=g) + 1).view(batch, blocks_per_seq)
    caches = [
        (
            torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE),
            torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE),
        )
        for _ in range(copies)
    ]
    return {
        "tables": tables.to(torch.int32).to(DEVICE),
        "lens": torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        "caches": caches,
    }


def _check(case: dict[str, Any], q: torch.Tensor, ql: int, context: int) -> float:
    batch = case["lens"].shape[0]
    k_cache, v_cache = case["caches"][0]
    out = ta.decode_attention(q, k_cache, v_cache, case["lens"], case["tables"], 0.088,
                              query_len=ql)  # fmt: skip
    meta = AttentionMetadata(
        positions=torch.zeros(batch * ql, dtype=torch.int64, device=DEVICE),
        slot_mapping=torch.zeros(batch * ql, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * ql,
        seq_lens=case["lens"],
        block_tables=case["tables"],
        num_decode=batch,
        query_lens_host=[ql] * batch,
        seq_lens_host=[context] * batch,
        max_query_len=ql,
        max_seq_len=context,
        decode_query_len=ql,
    )
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.088)
    return float((out.float() - ref).norm() / ref.norm())


def _time_us(case: dict[str, Any], q: torch.Tensor, ql: int, calls: int, replays: int) -> float:
    out = torch.empty_like(q)

    def body() -> None:
        for i in range(calls):
            k_cache, v_cache = case["caches"][i % len(case["caches"])]
            ta.decode_attention(q, k_cache, v_cache, case["lens"], case["tables"], 0.088,
                                out=out, query_len=ql)  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--query-lens", default="1,5")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--verify-warps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_verify_attention: needs a CUDA device", file=sys.stderr)
        return 2
    if args.verify_warps is not None:
        default = triton_decode._verify_config

        def config(dtype: torch.dtype, head_dim: int, block_h: int) -> tuple[int, int, int]:
            block_n, warps, stages = default(dtype, head_dim, block_h)
            return block_n, (args.verify_warps if block_h >= 32 else warps), stages

        triton_decode._verify_config = config  # type: ignore[assignment]
    kv_bytes_per_token = KV_HEADS * HEAD_DIM * 2 * 2
    results = []
    print(f"{'B':>4} {'Q':>2} {'splits':>6} {'us':>8} {'GB/s':>7} {'us/Q=1':>7} {'rel_err':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        cache_bytes = 2 * (1 + batch * math.ceil(args.context / BLOCK_SIZE)) * BLOCK_SIZE
        cache_bytes *= KV_HEADS * HEAD_DIM * 2
        copies = max(1, math.ceil(256 * 2**20 / cache_bytes))
        case = _case(batch, args.context, copies, seed=batch)
        base = None
        for ql in (int(x) for x in args.query_lens.split(",")):
            g = torch.Generator().manual_seed(ql)
            q = torch.randn(batch * ql, Q_HEADS, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
            err = _check(case, q, ql, args.context) if ql > 1 else 0.0
            us = _time_us(case, q, ql, args.calls, args.replays)
            base = us if ql == 1 else base
            splits = triton_decode.decode_num_splits(
                batch, KV_HEADS, case["tables"].shape[1], BLOCK_SIZE, q.device
            )
            gbs = batch * args.context * kv_bytes_per_token / (us * 1e-6) / 1e9
            ratio = us / base if base else float("nan")
            print(
                f"{batch:>4} {ql:>2} {splits:>6} {us:>8.2f} {gbs:>7.0f} {ratio:>7.2f} {err:>8.1e}"
            )
            results.append({"batch": batch, "query_len": ql, "num_splits": splits, "us": us,
                            "gb_per_s": gbs, "vs_q1": ratio, "rel_err": err})  # fmt: skip
    if args.out is not None:
        record = {
            "device": torch.cuda.get_device_name(),
            "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "block_size": BLOCK_SIZE, "dtype": "bfloat16", "context": args.context},
            "verify_warps": args.verify_warps,
            "results": results,
        }  # fmt: skip
        args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
