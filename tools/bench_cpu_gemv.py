"""CPU projection speed by implementation, weights from memory (not cache): `F.linear` (MKL),
oneDNN's inner product over the dense weights and over copies it reordered into its blocked
layout (`onednn-packed`, `METRALE_CPU_LINEAR=packed`), and our few-row C GEMV
(`metrale.kernels.cpu_gemv`), against `tensor.sum()` over the same weights (what streaming the
bytes costs, the floor).

    PYTHONPATH=. .venv/bin/python tools/bench_cpu_gemv.py [--threads 1] [--rows 1,4,16]

Two measurements, implementations interleaved round by round (the machine is shared, so each
figure is the median over rounds, with its range):
- per shape of the "small" Qwen3 (gate_up, down, qkv, o, lm_head) and row count: microseconds
  per call over weights cycled through ~150 MB;
- "step": the 33 projections of one batch-1 decode step of that model (8 layers + lm_head,
  ~100 MB, each weight read once a step, as in serving), milliseconds per step.

Times are wall clock with one thread (`--threads 1`), else wall clock too; `--cpu-time`
measures the thread's CPU time instead (one thread only: less noise from other processes).
Writes a record under bench/records/ (instrument "cpu-gemv").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from metrale.bench.record import write_record
from metrale.kernels import cpu_gemv, cpu_linear

#: (out, in) of the "small" Qwen3's projections: gate_up, down, qkv, o, lm_head (vocab 512).
SHAPES = ((3072, 512), (512, 1536), (1024, 512), (512, 512))
LAYER = ((1024, 512), (512, 512), (3072, 512), (512, 1536))
LAYERS = 8
LM_HEAD = (512, 512)


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures one thread: use --threads 1")
    gemv = cpu_gemv.load_gemv()
    impls: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
        "sum": lambda x, w: w.sum(),
        "F.linear": F.linear,
        "onednn": _onednn,
        "gemv": gemv,
    }
    #: id(dense weight) -> oneDNN's reordered copy (made outside the timings).
    packs: dict[int, torch.Tensor] = {}
    impls["onednn-packed"] = lambda x, w: _onednn(x, packs[id(w)])
    figures: dict[str, dict[str, float]] = {}

    def pack(weights: list[torch.Tensor]) -> None:
        packs.clear()
        for w in weights:
            packs[id(w)] = torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.PACK_BATCH)

    def timed(fn: Callable[[], None]) -> float:
        start = clock()
        fn()
        return clock() - start

    for out_f, in_f in SHAPES:
        weights = [torch.randn(out_f, in_f) for _ in range(max(4, int(150e6 / (out_f * in_f * 4))))]
        pack(weights)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f)
            samples: dict[str, list[float]] = {name: [] for name in impls}
            for _ in range(args.rounds):
                for name, fn in impls.items():
                    for w in weights[:3]:
                        fn(x, w)

                    def sweep(fn: Callable = fn, x: torch.Tensor = x, ws: list = weights) -> None:
                        for _ in range(2):
                            for w in ws:
                                fn(x, w)

                    samples[name].append(timed(sweep) / (2 * len(weights)))
            line = []
            for name, s in samples.items():
                med = statistics.median(s)
                figures[f"{out_f}x{in_f} rows={rows} {name}"] = {
                    "us_per_call": med * 1e6, "us_min": min(s) * 1e6, "us_max": max(s) * 1e6,
                    "weight_gb_per_s": out_f * in_f * 4 / med / 1e9,
                }  # fmt: skip
                line.append(
                    f"{name} {med * 1e6:7.1f} us ({out_f * in_f * 4 / med / 1e9:4.1f} GB/s)"
                )
            print(f"{out_f}x{in_f} rows={rows:3d}  " + "  ".join(line), flush=True)
    # One decode step: every projection of the model once, in layer order.
    step = [torch.randn(o, i) for _ in range(LAYERS) for o, i in LAYER] + [torch.randn(*LM_HEAD)]
    megabytes = sum(w.numel() for w in step) * 4 / 1e6
    pack(step)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i) for i in {w.shape[1] for w in step}}
        samples = {name: [] for name in impls}
        for _ in range(args.rounds * 4):
            for name, fn in impls.items():

                def one_step(fn: Callable = fn, xs: dict = xs) -> None:
                    for w in step:
                        fn(xs[w.shape[1]], w)

                one_step()
                samples[name].append(timed(one_step))
        line = []
        for name, s in samples.items():
            med = statistics.median(s)
            figures[f"step rows={rows} {name}"] = {
                "ms_per_step": med * 1e3, "ms_min": min(s) * 1e3, "ms_max": max(s) * 1e3,
                "weight_gb_per_s": megabytes / 1e3 / med,
            }  # fmt: skip
            line.append(f"{name} {med * 1e3:6.2f} ms [{min(s) * 1e3:.2f}-{max(s) * 1e3:.2f}]")
        print(f"step ({megabytes:.0f} MB) rows={rows:3d}  " + "  ".join(line), flush=True)
    path = write_record(
        "cpu-gemv", model_shape="qwen3-small-projections", device="cpu",
        config={"threads": args.threads, "shapes": SHAPES, "dtype": "float32",
                "rounds": args.rounds, "clock": "thread_time" if args.cpu_time else "wall",
                "gemv_max_rows": cpu_gemv.MAX_ROWS},
        figures=figures,
        notes="peers in the same run, interleaved: sum (streaming the weights), F.linear (MKL), "
        "oneDNN; gemv is metrale's few-row C kernel",
    )  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
