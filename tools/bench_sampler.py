"""Where the sampler should switch from its torch path to the sort-free Triton kernel: time
`Sampler.sample` (the whole call, as the engine makes it) for batches of non-greedy rows with
`kernel_min_rows=1, kernel_for_full_sort_only=False` (always the kernel) and
`kernel_min_rows=None` (always torch).

Usage (GPU): PYTHONPATH=. python3 tools/bench_sampler.py [--out result.json]
The result decides the sampler's routing (`metrale.sampling.sampler.KERNEL_MIN_ROWS` and the
full-sort rule): per setting, the smallest batch from which the kernel is at least as fast at
every larger batch. `--profile` prints torch.profiler tables of one-row calls instead.
"""

from __future__ import annotations

import argparse
import json

import torch

from metrale.kernels.triton_ops import triton_kernel_ops
from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import Sampler, SamplingRow

VOCAB = 151_936
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SETTINGS = {
    "top_k50_top_p0.9_t0.8": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_p0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "t0.7": SamplingParams(temperature=0.7),
}


def time_ms(fn: object, iters: int = 30) -> float:
    for _ in range(3):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()  # type: ignore[operator]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="profile one call per setting")
    args = parser.parse_args()
    device = torch.device("cuda")
    ops = triton_kernel_ops()
    samplers = {
        "kernel": Sampler(seed=0, ops=ops, kernel_min_rows=1, kernel_for_full_sort_only=False),
        "torch": Sampler(seed=0, ops=ops, kernel_min_rows=None),
    }
    g = torch.Generator(device=device).manual_seed(0)
    result: dict[str, dict[str, dict[str, float]]] = {}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        logits = torch.randn(1, VOCAB, generator=g, device=device)
        for name, params in SETTINGS.items():
            for path, sampler in samplers.items():
                rows = [SamplingRow(params=params)]
                time_ms(lambda s=sampler, r=rows: s.sample(logits, r).to_host(), iters=3)
                acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                with profile(activities=acts) as prof:
                    for _ in range(5):
                        sampler.sample(logits, rows).to_host()
                print(f"== {name} {path} (5 calls, B=1)")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12,
                                                max_name_column_width=50))  # fmt: skip
    for name, params in SETTINGS.items():
        result[name] = {}
        for batch in BATCHES:
            logits = torch.randn(batch, VOCAB, generator=g, device=device) * 2.5
            rows = [SamplingRow(params=params) for _ in range(batch)]
            figures = {}
            for path, sampler in samplers.items():
                figures[path] = time_ms(
                    lambda s=sampler, x=logits, r=rows: s.sample(x, r).to_host()
                )
            result[name][str(batch)] = figures
            print(f"{name:24s} B={batch:4d} kernel {figures['kernel']:.3f} ms  "
                  f"torch {figures['torch']:.3f} ms", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
