"""GPU time of one captured decode graph replay (no host work between replays): the decode-path
kernels launched as programmatic dependents (PDL, the default on sm_90+) and not, and the
projections on cuBLAS; plus the kernel breakdown of one eager step.

Usage (GPU): PYTHONPATH=. python3 tools/graph_step_time.py bench/configs/qwen3-8b [--rows 1]
    [--context 256] [--variants gemv_pdl,gemv,cublas]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from metrale import Engine, EngineConfig
from metrale.bench.synthetic import prepare_model_dir
from metrale.kernels import triton_ops


def replay_ms(engine: Engine, rows: int, context: int, iters: int = 200) -> float:
    runner = engine.model.graph_runner
    assert runner is not None and runner.graphs, "no decode graphs were captured"
    bs = runner.block_size
    blocks = (context + bs) // bs + 1
    tables = np.arange(1, 1 + rows * blocks, dtype=np.int64).reshape(rows, blocks)
    tokens = np.full(rows, 7, dtype=np.int64)
    positions = np.full(rows, context, dtype=np.int64)
    runner.run(tokens, positions, tables)
    rung = next(r for r in runner.rungs if r >= rows)
    graph = runner.graphs[rung, 1]
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config_dir")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default="gemv_pdl,gemv,cublas",
                        help="comma-separated subset of gemv_pdl,gemv,cublas")  # fmt: skip
    args = parser.parse_args()
    blocks_needed = args.rows * ((args.context + 16) // 16 + 2) + 16
    model_dir = str(prepare_model_dir(args.config_dir))
    result = {}
    for variant in args.variants.split(","):
        os.environ["METRALE_PDL"] = "1" if variant == "gemv_pdl" else "0"
        if variant == "cublas":  # this run only: keep the projections on torch
            for name in ("linear", "silu_mul_linear"):
                triton_ops.TRITON_OPS.pop(name, None)
        engine = Engine(
            EngineConfig(
                model=model_dir, load_format="dummy", max_model_len=2048,
                max_num_seqs=max(8, args.rows), enable_prefix_caching=False,
                num_kv_blocks=max(1024, blocks_needed),
            )
        )  # fmt: skip
        result[f"{variant}_replay_ms"] = replay_ms(engine, args.rows, args.context)
        print(variant, result[f"{variant}_replay_ms"], flush=True)
        if variant == "gemv_pdl":
            runner = engine.model.graph_runner
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    runner._body(args.rows)  # the inputs replay_ms staged
                torch.cuda.synchronize()
            table = prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
            )
            print(table)
            # The same step as captured: CUPTI attributes the kernels inside graph replays.
            rung = next(r for r in runner.rungs if r >= args.rows)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    runner.graphs[rung, 1].replay()
                torch.cuda.synchronize()
            print("graph replay kernels (5 replays):")
            print(
                prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
                )
            )
        del engine
        torch.cuda.empty_cache()
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
