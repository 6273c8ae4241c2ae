"""CPU projection speed by implementation: `F.linear` (MKL) against oneDNN's inner product
(`metrale.kernels.cpu_linear.linear`) on the small model's weight shapes, at 1, 16 and 256
rows, with weights cycled through ~100 MB so they come from memory, not cache.

    PYTHONPATH=. .venv/bin/python tools/bench_cpu_gemv.py [--threads 2]

Writes a record under bench/records/ (instrument "cpu-gemv"): microseconds per call and the
weight bytes read per second, per shape, rows and implementation.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from metrale.bench.record import write_record
from metrale.kernels import cpu_linear

#: (out, in) of the "small" Qwen3's projections: gate_up, down, qkv, o.
SHAPES = ((3072, 512), (512, 1536), (1024, 512), (512, 512))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    impls = {"F.linear": F.linear, "onednn": cpu_linear.linear}
    figures: dict[str, dict[str, float]] = {}
    for out_f, in_f in SHAPES:
        weights = [torch.randn(out_f, in_f) for _ in range(max(4, int(100e6 / (out_f * in_f * 4))))]
        for rows in (1, 16, 256):
            x = torch.randn(rows, in_f)
            for name, fn in impls.items():
                for w in weights[:3]:
                    fn(x, w)
                start = time.perf_counter()
                for _ in range(3):
                    for w in weights:
                        fn(x, w)
                seconds = (time.perf_counter() - start) / (3 * len(weights))
                figures[f"{out_f}x{in_f} rows={rows} {name}"] = {
                    "us_per_call": seconds * 1e6,
                    "weight_gb_per_s": out_f * in_f * 4 / seconds / 1e9,
                }
                print(f"{out_f}x{in_f} rows={rows:4d} {name:9s} {seconds * 1e6:8.1f} us")
    path = write_record(
        "cpu-gemv", model_shape="qwen3-small-projections", device="cpu",
        config={"threads": args.threads, "shapes": SHAPES, "dtype": "float32"},
        figures=figures, notes="peer: F.linear (MKL) in the same run",
    )  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
