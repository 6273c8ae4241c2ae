"""Small-M GEMV benchmark: `triton_gemv.gemv` (every candidate config) against cuBLAS
(`F.linear`) on Qwen3-8B's decode GEMMs, with the device's copy bandwidth as the ceiling.

Usage (CUDA only; about a minute on an H200, Triton compilation included):
    PYTHONPATH=. python tools/bench_gemv.py --out $OUT/gemv.json

Method:
- Each case is timed as a CUDA-graph replay of many back-to-back calls (the way decode runs
  them), median of several replays divided by the number of calls. The calls rotate over
  enough copies of the weight (>= 256 MiB together) that no call finds its weight in L2.
- `GB/s` = bytes of W / time per call (x and the output are noise); `%copy` divides it by the
  measured device-to-device copy bandwidth (`dst.copy_(src)` of 1 GiB, counted as read +
  write = 2 x 1 GiB per copy).
- Every config is checked first against `F.linear` and against the float32 reference
  `x.float() @ W.float().T` (max abs error, reported; a config failing the bound is flagged).
- Candidates come from `triton_gemv.candidate_configs` (the default heuristic's pick first);
  they are compiled up front in `--jobs` worker processes that fill Triton's on-disk cache.
  `down+silu` times the fused `gemv_silu_mul` against `silu_and_mul` then `F.linear`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

from metrale.kernels import reference
from metrale.kernels import triton_gemv as tg
from metrale.kernels import triton_norm as tn
from metrale.kernels.triton_gemv import GemvConfig

DTYPE = torch.bfloat16
#: name -> (N, K) of Qwen3-8B's decode GEMMs (fused projections as the engine runs them).
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
#: The weight copies one timing rotates over total at least this many bytes (L2 is 50 MB).
ROTATE_BYTES = 256 << 20
#: Weight bytes one graph replay reads (sets the number of calls captured).
REPLAY_BYTES = 2 << 30
REPLAYS = 7
#: A config whose max error against F.linear exceeds this many output ulps is flagged.
ULPS_FLAGGED = 4

Job = tuple[str, int, int, int, dict[str, int] | None]


# -------------------------------------------------------------------------------------------
# Parallel compilation (fills Triton's cache; the main process then loads the binaries)
# -------------------------------------------------------------------------------------------


def _config(d: dict[str, int] | None) -> GemvConfig | None:
    return GemvConfig(**d) if d is not None else None


def _compile_jobs(jobs: list[Job]) -> int:
    """Run each job once on the device (garbage data), compiling what it launches."""
    done = 0
    for kind, n, k, m, cfg in jobs:
        try:
            w = torch.empty(n, k, dtype=DTYPE, device="cuda")
            if kind == "silu":
                tg.gemv_silu_mul(
                    torch.zeros(m, 2 * k, dtype=DTYPE, device="cuda"), w, config=_config(cfg)
                )
            else:
                tg.gemv(torch.zeros(m, k, dtype=DTYPE, device="cuda"), w, config=_config(cfg))
            done += 1
        except Exception as exc:  # the main process compiles (and reports) it again
            print(f"precompile {kind} {n}x{k} M={m} {cfg}: {exc!r}", file=sys.stderr)
    torch.cuda.synchronize()
    return done


def precompile(jobs: list[Job], sms: int, workers: int, timeout_s: float) -> None:
    """Compile every distinct specialisation `jobs` need in `workers` processes at once."""
    if workers <= 1 or not jobs:
        return
    # Deduplicate by what Triton specialises on (config, M, split or not), not by shape.
    unique: dict[tuple[Any, ...], Job] = {}
    for job in jobs:
        kind, n, k, m, cfg = job
        config = _config(cfg) or tg.default_config(m, n, k, DTYPE, sms)
        key = (kind, m, config.split_k > 1, dataclasses.replace(config, split_k=0))
        unique.setdefault(key, job)
    todo = list(unique.values())
    chunks = [todo[i::workers] for i in range(workers)]
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futures = [pool.submit(_compile_jobs, chunk) for chunk in chunks if chunk]
    finished, pending = wait(futures, timeout=timeout_s)
    pool.shutdown(wait=not pending, cancel_futures=True)
    ok = sum(f.result() for f in finished if f.exception() is None)
    print(
        f"precompiled {ok}/{len(todo)} specialisations in {workers} processes "
        f"({time.perf_counter() - start:.1f} s)"
    )


# -------------------------------------------------------------------------------------------
# Timing
# -------------------------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB bf16, GB/s counting read + write."""
    n = (1 << 30) // 2
    src = torch.randn(n, device="cuda").to(DTYPE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times) / 1e9


def time_per_call(fn: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> float:
    """Seconds per call of `fn(weight)`: a graph of `calls` calls rotating over `weights`."""
    nbytes = weights[0].numel() * weights[0].element_size()
    calls = max(len(weights), min(256, math.ceil(REPLAY_BYTES / nbytes)))
    calls = math.ceil(calls / len(weights)) * len(weights)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (cuBLAS handles, Triton loads) off the capture
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    del graph
    return statistics.median(times)


def ulp(t: torch.Tensor) -> float:
    """One unit in the last place of `t`'s dtype at the largest magnitude of `t`."""
    big = float(t.abs().max()) or 1.0
    return 2.0 ** math.floor(math.log2(big)) * torch.finfo(t.dtype).eps


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max())


# -------------------------------------------------------------------------------------------
# Main
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Table:
    """Result rows, printed as they come and kept for the JSON."""

    copy_gbps: float
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    HEADER = (
        f"{'shape':<9} {'M':>1} {'impl':<30} {'us':>8} {'GB/s':>6} {'%copy':>6} "
        f"{'vs cuBLAS':>9} {'err':>9} {'err fp32':>9}"
    )

    def add(
        self,
        shape: str,
        m: int,
        impl: str,
        nbytes: int,
        secs: float | None,
        *,
        base: float | None = None,
        err: float | None = None,
        err32: float | None = None,
        flagged: bool = False,
        config: GemvConfig | None = None,
    ) -> None:
        gbps = nbytes / secs / 1e9 if secs else None
        self.rows.append(
            {
                "shape": shape,
                "m": m,
                "impl": impl,
                "config": dataclasses.asdict(config) if config else None,
                "us": secs * 1e6 if secs else None,
                "gbps": gbps,
                "frac_copy": gbps / self.copy_gbps if gbps else None,
                "speedup_vs_cublas": base / secs if base and secs else None,
                "max_err_vs_flinear": err,
                "max_err_vs_fp32": err32,
                "flagged": flagged,
            }
        )
        cells = [
            f"{shape:<9} {m:>1} {impl:<30}",
            f"{secs * 1e6:8.2f}" if secs else f"{'-':>8}",
            f"{gbps:6.0f}" if gbps else f"{'-':>6}",
            f"{100 * gbps / self.copy_gbps:5.1f}%" if gbps else f"{'-':>6}",
            f"{base / secs:8.3f}x" if base and secs else f"{'':>9}",
            f"{err:9.2e}" if err is not None else f"{'':>9}",
            f"{err32:9.2e}" if err32 is not None else f"{'':>9}",
        ]
        print(" ".join(cells) + ("  FLAGGED" if flagged else ""))


def bench_case(
    table: Table,
    name: str,
    weights: list[torch.Tensor],
    m: int,
    configs: list[GemvConfig],
    deadline: float,
    gen: torch.Generator,
) -> dict[str, Any] | None:
    """cuBLAS and every config for one shape and M; returns the fastest correct config."""
    n, k = weights[0].shape
    nbytes = n * k * weights[0].element_size()
    x = torch.randn(m, k, device="cuda", generator=gen).to(DTYPE)
    ref = F.linear(x, weights[0])
    ref32 = x.float() @ weights[0].float().T
    base = time_per_call(lambda w: F.linear(x, w), weights)
    table.add(name, m, "cublas F.linear", nbytes, base, err32=max_err(ref, ref32))
    results = []
    for i, cfg in enumerate(configs):
        label = ("default " if i == 0 else "") + cfg.describe()
        if i > 0 and time.perf_counter() > deadline:
            table.add(name, m, label + " (skipped)", nbytes, None, config=cfg)
            continue
        out = tg.gemv(x, weights[0], config=cfg)
        err = max_err(out, ref)
        flagged = not err <= ULPS_FLAGGED * ulp(ref)
        secs = time_per_call(lambda w, cfg=cfg: tg.gemv(x, w, config=cfg), weights)
        table.add(name, m, label, nbytes, secs, base=base, err=err,
                  err32=max_err(out, ref32), flagged=flagged, config=cfg)  # fmt: skip
        if not flagged:
            results.append((secs, i, cfg))
    if not results:
        return None
    secs, i, cfg = min(results, key=lambda t: t[0])
    gbps = nbytes / secs / 1e9
    return {
        "config": dataclasses.asdict(cfg),
        "is_default": i == 0,
        "us": secs * 1e6,
        "gbps": gbps,
        "frac_copy": gbps / table.copy_gbps,
        "speedup_vs_cublas": base / secs,
    }


def bench_fused_down(
    table: Table, weights: list[torch.Tensor], m: int, gen: torch.Generator
) -> None:
    """down_proj(silu(gate) * up): torch, fused `gemv_silu_mul`, Triton activation + gemv."""
    n, k = weights[0].shape
    nbytes = n * k * weights[0].element_size()
    gate_up = torch.randn(m, 2 * k, device="cuda", generator=gen).to(DTYPE)
    act = tn.silu_and_mul(gate_up)
    ref = F.linear(act, weights[0])
    ref32 = act.float() @ weights[0].float().T
    base = time_per_call(lambda w: F.linear(reference.silu_and_mul(gate_up), w), weights)
    table.add("down+silu", m, "torch silu*up + F.linear", nbytes, base, err32=max_err(ref, ref32))
    out = tg.gemv_silu_mul(gate_up, weights[0])
    err = max_err(out, ref)
    secs = time_per_call(lambda w: tg.gemv_silu_mul(gate_up, w), weights)
    table.add("down+silu", m, "fused gemv_silu_mul (default)", nbytes, secs, base=base, err=err,
              err32=max_err(out, ref32), flagged=not err <= ULPS_FLAGGED * ulp(ref))  # fmt: skip
    secs = time_per_call(lambda w: tg.gemv(tn.silu_and_mul(gate_up), w), weights)
    table.add("down+silu", m, "triton silu_and_mul + gemv", nbytes, secs, base=base)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    deadline = started + args.budget_s
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    ms = [int(m) for m in args.ms.split(",")]
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    plan = {
        (name, m): tg.candidate_configs(m, n, k, DTYPE, sms)[: args.max_configs]
        for name, (n, k) in shapes.items()
        for m in ms
    }
    jobs: list[Job] = [
        ("plain", *shapes[name], m, dataclasses.asdict(c))
        for (name, m), configs in plan.items()
        for c in configs
    ]
    if "down" in shapes:
        jobs += [("silu", *shapes["down"], m, None) for m in ms]
    precompile(jobs, sms, args.jobs, timeout_s=args.budget_s / 2)

    table = Table(copy_bandwidth())
    print(f"{props.name}: {sms} SMs, copy bandwidth {table.copy_gbps:.0f} GB/s (read + write)")
    print(Table.HEADER)
    best: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        copies = max(1, math.ceil(ROTATE_BYTES / (n * k * DTYPE.itemsize)))
        weights = [
            (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(DTYPE)
            for _ in range(copies)
        ]
        for m in ms:
            found = bench_case(table, name, weights, m, plan[(name, m)], deadline, gen)
            if found is not None:
                best[f"{name}/M{m}"] = found
            if name == "down":
                bench_fused_down(table, weights, m, gen)
        del weights
        torch.cuda.empty_cache()

    print("\nfastest correct config per case:")
    for case, b in best.items():
        print(
            f"  {case:<12} {GemvConfig(**b['config']).describe():<22} "
            f"{'(default)' if b['is_default'] else '':<10}{b['us']:8.2f} us "
            f"{b['gbps']:6.0f} GB/s {100 * b['frac_copy']:5.1f}% of copy, "
            f"{b['speedup_vs_cublas']:.3f}x cuBLAS"
        )
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.1f} s")
    return {
        "device": props.name,
        "sms": sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE),
        "copy_gbps": table.copy_gbps,
        "rotate_bytes": ROTATE_BYTES,
        "rows": table.rows,
        "best": best,
        "elapsed_s": elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--ms", default="1,2,4", help="rows of x (comma-separated)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES))
    parser.add_argument("--max-configs", type=int, default=10, help="candidates per case")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="compile worker processes (<= 1: compile in-process)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=65.0,
        help="after this many seconds only defaults are timed",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA device", file=sys.stderr)
        return 2
    result = bench(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
