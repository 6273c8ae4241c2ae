"""What sampling costs per step: time `Sampler.sample` (the whole call, as the engine makes it,
read back with `to_host`) for batches of non-greedy rows through each path:

- "candidates": the default sampler (`metrale.sampling.candidates`: rows with a top-k draw on
  their top candidates; other settings fall through to the full-row paths, as in serving);
- "kernel": `kernel_min_rows=1, kernel_for_full_sort_only=False`, no candidates (always the
  sort-free Triton kernel);
- "torch": `kernel_min_rows=None`, no candidates (always the torch path);
- "greedy": the same batch of greedy rows (the one-pass `greedy_logprobs` kernel), the
  baseline the sampled step is measured against (issue 23: a sampled batch within 0.15 ms
  of greedy at 1 row and 0.5 ms at 128 rows).

Two figures per path: "ms", whole calls back to back (host launch overhead included, as when
nothing else runs), and "gpu_ms", what a call adds behind a busy GPU (`torch.cuda._sleep`
of `--busy-ms` first, so the host launches it while the GPU is still busy, as the engine
launches the sampler behind the decode forward; the difference against the sleep alone,
including the wake-up of `to_host`'s wait, which greedy pays too). The step-time bar is on
"gpu_ms": candidates over greedy.

Usage (GPU): PYTHONPATH=. python3 tools/bench_sampler.py [--out result.json]
Per setting and batch it prints each path's figures and the candidate path's excess over
greedy, and writes them (with the sampler's path counters, so a batch that fell back shows)
to `--out`. The kernel/torch figures decide the full-row routing
(`metrale.sampling.sampler.KERNEL_MIN_ROWS` and the full-sort rule). `--profile` prints
torch.profiler tables of calls of `--profile-batch` rows (default 1) instead.
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
    "top_k50_top_p0.95_t0.8": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    "top_k50_top_p0.9_t0.8": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_k20_min_p0.05_t0.7": SamplingParams(temperature=0.7, top_k=20, min_p=0.05),
    "top_p0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "t0.7": SamplingParams(temperature=0.7),
}


def time_ms(fn: object, iters: int = 30, warmup: int = 3) -> float:
    """Mean ms of `iters` back-to-back calls of `fn` (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()  # type: ignore[operator]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gpu_ms(fn: object, busy_cycles: int, iters: int = 10) -> float:
    """What `fn` (one call, read back) adds behind `busy_cycles` of GPU sleep: the median of
    `iters` timed runs with the call minus the median without it."""

    def run(with_call: bool) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(busy_cycles)
        if with_call:
            fn()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    run(True)
    base = sorted(run(False) for _ in range(iters))[iters // 2]
    loaded = sorted(run(True) for _ in range(iters))[iters // 2]
    return loaded - base


def cycles_per_ms() -> float:
    """GPU sleep cycles per millisecond (`torch.cuda._sleep` counts clock cycles)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="profile one call per setting")
    parser.add_argument("--busy-ms", type=float, default=3.0, help="GPU sleep before gpu_ms")
    parser.add_argument("--profile-batch", type=int, default=1, help="rows of a profiled call")
    args = parser.parse_args()
    device = torch.device("cuda")
    ops = triton_kernel_ops()
    samplers = {
        "candidates": Sampler(seed=0, ops=ops),
        "kernel": Sampler(
            seed=0, ops=ops, kernel_min_rows=1, kernel_for_full_sort_only=False,
            candidate_k_max=None,
        ),
        "torch": Sampler(seed=0, ops=ops, kernel_min_rows=None, candidate_k_max=None),
    }  # fmt: skip
    greedy_sampler = Sampler(seed=0, ops=ops)
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator(device=device).manual_seed(0)
    busy = int(args.busy_ms * cycles_per_ms())
    result: dict[str, dict[str, dict[str, float]]] = {}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        nrows = args.profile_batch
        logits = (torch.randn(nrows, VOCAB, generator=g, device=device) * 2.5).bfloat16().float()
        for name, params in SETTINGS.items():
            for path, sampler in samplers.items():
                rows = [SamplingRow(params=params) for _ in range(nrows)]
                time_ms(lambda s=sampler, r=rows: s.sample(logits, r).to_host(), iters=3)
                acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                with profile(activities=acts) as prof:
                    for _ in range(5):
                        sampler.sample(logits, rows).to_host()
                print(f"== {name} {path} (5 calls, B={nrows})")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12,
                                                max_name_column_width=50))  # fmt: skip
    for name, params in SETTINGS.items():
        result[name] = {}
        for batch in BATCHES:
            # bf16-valued float32 logits, as the engine's graphs hand the sampler (ties).
            logits = (torch.randn(batch, VOCAB, generator=g, device=device) * 2.5).bfloat16()
            logits = logits.float()
            rows = [SamplingRow(params=params) for _ in range(batch)]
            greedy_rows = [SamplingRow(params=greedy) for _ in range(batch)]
            calls = {
                "greedy": lambda x=logits, r=greedy_rows: greedy_sampler.sample(x, r).to_host()
            }
            for path, sampler in samplers.items():
                calls[path] = lambda s=sampler, x=logits, r=rows: s.sample(x, r).to_host()
            figures = {}
            for path, call in calls.items():
                figures[path] = time_ms(call)
                figures[f"{path}_gpu"] = gpu_ms(call, busy)
            figures["candidates_over_greedy"] = figures["candidates"] - figures["greedy"]
            figures["candidates_over_greedy_gpu"] = (
                figures["candidates_gpu"] - figures["greedy_gpu"]
            )
            result[name][str(batch)] = figures
            print(f"{name:24s} B={batch:4d} ms (gpu_ms): greedy {figures['greedy']:.3f} "
                  f"({figures['greedy_gpu']:.3f})  candidates {figures['candidates']:.3f} "
                  f"({figures['candidates_gpu']:.3f}; +{figures['candidates_over_greedy_gpu']:.3f}"
                  f" over greedy)  kernel {figures['kernel']:.3f} ({figures['kernel_gpu']:.3f})"
                  f"  torch {figures['torch']:.3f} ({figures['torch_gpu']:.3f})",
                  flush=True)  # fmt: skip
    counters = {path: sampler.stats for path, sampler in samplers.items()}
    print("path counters:", counters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ms": result, "counters": counters}, f, indent=1)


if __name__ == "__main__":
    main()
