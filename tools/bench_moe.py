"""MoE kernel benchmark: `triton_moe.moe_experts` (each path where it applies) and
`moe_softmax_topk` on one layer of the Qwen3-30B-A3B and Mixtral-8x7B shapes, bf16, across
batch sizes, against the device's copy bandwidth, with the torch reference for comparison.

Usage (CUDA only; a few minutes on an H200, compilation included):
    PYTHONPATH=. python tools/bench_moe.py --out $OUT/moe_kernels.json

Method:
- One layer's stacked experts (random bf16; Qwen3-30B-A3B 1.2 GB, Mixtral 2.8 GB: far above
  L2). Each timing is a CUDA-graph replay of `CALLS` back-to-back calls, each on its own
  routing (uniform random top-k per token), median of several replays / CALLS.
- `routed GB/s` = the distinct experts' weight bytes each call must read (averaged over the
  calls' routings) / time; `%copy` divides by the measured copy bandwidth. That is the
  roofline fraction of the expert part of a step (attention and the rest come on top).
- Each path that applies is timed (the GEMV up to 256 assignments, the grouped GEMM always)
  so the crossover `triton_moe.GEMV_MAX_ASSIGNMENTS` can be checked; `auto` is the engine's
  choice; `softmax_experts` is the layer's whole op from the router logits (routing fused into
  the GEMV at small batches). The torch reference runs eagerly (it syncs with the host), timed
  per call.
- Every path is first checked against the torch reference in float32 (relative error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from metrale.bench.hardware import copy_bandwidth
from metrale.kernels import ssm_reference, triton_moe

#: name -> (experts, top_k, hidden, intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 256, 2048)
CALLS = 8
REPLAYS = 7


def _routing(tokens: int, experts: int, top_k: int, device: torch.device) -> tuple:
    ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, device=device), dim=-1)
    return ids, weights.to(torch.bfloat16)


def _graph_time(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call: median of REPLAYS graph replays of `fn(i)` for i < calls."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(REPLAYS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _eager_time(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    fn(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def _bench_batch(
    tokens: int, shape: tuple[int, int, int, int], w_in: torch.Tensor, w_out: torch.Tensor,
    bandwidth: float,
) -> dict:  # fmt: skip
    experts, top_k, hidden, inter = shape
    device, bf = w_in.device, torch.bfloat16
    xs = [torch.randn(tokens, hidden, device=device, dtype=bf) for _ in range(CALLS)]
    routes = [_routing(tokens, experts, top_k, device) for _ in range(CALLS)]
    distinct = statistics.mean(len(set(r[0].flatten().tolist())) for r in routes)
    routed = distinct * 3 * hidden * inter * 2
    row: dict = {"tokens": tokens, "distinct_experts": distinct, "routed_bytes": routed}
    want = None
    if tokens <= 256:
        ids0, w0 = routes[0]
        want = ssm_reference.moe_experts(
            xs[0].float(), w_in.float(), w_out.float(), ids0, w0.float(), True, "silu"
        )

    def call(i: int, forced: str | None) -> torch.Tensor:
        ids, w = routes[i]
        return triton_moe.moe_experts(xs[i], w_in, w_out, ids, w, True, "silu", path=forced)

    paths = ["auto", "grouped"] + (["gemv"] if tokens * top_k <= 256 else [])
    for path in paths:
        forced = None if path == "auto" else path
        if want is not None:
            got = call(0, forced).float()
            row[f"{path}_rel_err"] = float((got - want).norm() / want.norm())
        seconds = _graph_time(lambda i, f=forced: call(i, f), CALLS)
        row[f"{path}_us"] = seconds * 1e6
        row[f"{path}_routed_gb_s"] = routed / seconds / 1e9
        row[f"{path}_pct_copy"] = 100 * routed / seconds / bandwidth
    if tokens <= 64:

        def ref(i: int) -> torch.Tensor:
            ids, w = routes[i]
            return ssm_reference.moe_experts(xs[i], w_in, w_out, ids, w, True, "silu")

        row["torch_us"] = _eager_time(ref, CALLS) * 1e6
    logits = [torch.randn(tokens, experts, device=device, dtype=bf) for _ in range(CALLS)]
    row["route_us"] = 1e6 * _graph_time(
        lambda i: triton_moe.moe_softmax_topk(logits[i], top_k, True, bf), CALLS
    )
    row["softmax_experts_us"] = 1e6 * _graph_time(
        lambda i: triton_moe.moe_softmax_experts(
            xs[i], logits[i], w_in, w_out, top_k, True, bf, True, "silu"
        ),
        CALLS,
    )
    row["route_torch_us"] = 1e6 * _graph_time(
        lambda i: ssm_reference.moe_softmax_topk(logits[i], top_k, True, bf), CALLS
    )
    return row


def _bench_shape(name: str, batches: list[int], bandwidth: float) -> list[dict]:
    experts, _, hidden, inter = SHAPES[name]
    device, bf = torch.device("cuda"), torch.bfloat16
    w_in = torch.randn(experts, 2 * inter, hidden, device=device, dtype=bf) * hidden**-0.5
    w_out = torch.randn(experts, hidden, inter, device=device, dtype=bf) * inter**-0.5
    rows = []
    for tokens in batches:
        row = _bench_batch(tokens, SHAPES[name], w_in, w_out, bandwidth)
        rows.append(row)
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                for k, v in row.items()}))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe needs CUDA", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results: dict = {"copy_bandwidth_gb_s": bandwidth / 1e9, "shapes": {}}
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.shapes.split(","):
        results["shapes"][name] = _bench_shape(name, batches, bandwidth)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
