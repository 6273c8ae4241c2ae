"""FP8 weights against bf16 weights: batch-1 decode of one model shape (random weights), each
with its own roofline, in one run and one record (issue 22).

Usage (CUDA only; about two minutes on an H200 for Qwen3-8B, two engine start-ups):
    PYTHONPATH=. python tools/bench_fp8.py --config-dir bench/configs/qwen3-8b --out-dir $OUT

Method (the `metrale bench latency` instrument, `metrale.bench.offline`, run twice):
- The same shape is loaded with `--load-format dummy` in bf16, then with `--quantization fp8`
  (the random bf16 weights quantized at load, per-channel scales: the attention and MLP
  projections in FP8, embeddings / lm_head / norms in bf16), then (unless `--no-block`) with
  `--quantization fp8-block` (128x128 block scales: the layout of FP8 checkpoints, recorded
  beside the bars, not one of them). Each engine decodes `--tokens`
  tokens after a `--prompt-len` prompt at batch 1 (CUDA graphs as served), after a 16-token
  warm-up; tok/s = (generated - 1) / (last token - first token).
- Roofline of each: measured copy bandwidth / bytes one decode step reads, where the bytes
  count every weight at its stored size (FP8 weights 1 byte, their float32 scales 4 bytes per
  row, bf16 elsewhere; the embedding table one row unless tied) plus the KV of the mean
  context (`offline._bytes_per_step`).
- The bars (issue 22): FP8 tok/s >= 0.80 of the FP8 roofline, and >= 1.6x the bf16 tok/s.
  Both are written to the record (`bars`) and printed; the exit code is 0 either way (the
  record is the verdict), 1 only if a run failed.
- Also recorded: each engine's KV blocks (the pool gets the memory the FP8 weights free),
  weight bytes and `LoadReport.weight_dtype`.

`--kernels` instead times the projections alone on Qwen3-8B's shapes (for tuning
`triton_fp8.gemv_config` / `gemm_config` when the bars are missed): the bf16 GEMV against the
FP8 GEMV with per-row and 128x128 block scales at M = 1, 2, 4, 8 (GB/s of the weight bytes
each reads, % of the copy bandwidth), and the FP8 GEMM (block and per-row scales) against
cuBLAS bf16 at M = 16, 64, 128, 512, 4096 (TFLOP/s), each a CUDA-graph replay of many calls rotating over weight copies that do
not fit L2 (`tools/bench_gemv.time_per_call`). Record `fp8-kernels`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from metrale.bench import offline
from metrale.bench.record import write_record

#: Issue 22's bars.
ROOFLINE_BAR = 0.80
SPEEDUP_BAR = 1.6


def _measure(args: argparse.Namespace, quantization: str | None) -> dict[str, Any]:
    from metrale.bench.hardware import copy_bandwidth

    engine = offline._engine(args, max_num_seqs=args.max_num_seqs, quantization=quantization)
    offline.decode_latency(engine, args.prompt_len, 16, seed=99)  # warm-up
    figures: dict[str, Any] = offline.decode_latency(engine, args.prompt_len, args.tokens)
    bandwidth = copy_bandwidth(engine.model.device)
    per_step = offline._bytes_per_step(engine, args.prompt_len + args.tokens // 2)["total"]
    report = engine.load_report
    figures.update(
        copy_bandwidth_gb_s=bandwidth / 1e9,
        bytes_per_step=per_step,
        roofline_tok_s=bandwidth / per_step,
        roofline_ratio=figures["tok_s"] / (bandwidth / per_step),
        weights_bytes=report.weights_bytes if report else None,
        weight_dtype=report.weight_dtype if report else None,
        kv_blocks=engine.model.num_total_blocks(),
        kernels=dict(getattr(engine.model, "kernel_implementations", {})),
        cuda_graphs=getattr(engine.model, "graph_runner", None) is not None,
    )
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return figures


def _kernels(args: argparse.Namespace) -> int:
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).parent))
    import bench_gemv as bg  # a sibling tool, not a package

    from metrale.kernels import reference
    from metrale.kernels import triton_fp8 as tf
    from metrale.kernels import triton_gemv as tg

    copy_gbps = bg.copy_bandwidth()
    rows: list[dict[str, Any]] = []
    bf = torch.bfloat16

    def copies(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
        count = max(2, -(-bg.ROTATE_BYTES // (n * k * torch.finfo(dtype).bits // 8)))
        return [torch.randn(n, k, device="cuda").mul_(k**-0.5).to(dtype) for _ in range(count)]

    block = (128, 128)
    for name, (n, k) in bg.SHAPES.items():
        if name == "lm_head":
            continue
        w16 = copies(n, k, bf)
        w8 = [reference.quantize_fp8(w, None) for w in w16]
        wb = [reference.quantize_fp8(w, block) for w in w16]
        sc = {id(q): s for q, s in w8 + wb}  # each FP8 copy's scales
        q8, qb = [q for q, _ in w8], [q for q, _ in wb]
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda").to(bf)
            t16 = bg.time_per_call(lambda w, x=x: tg.gemv(x, w), w16)
            t8 = bg.time_per_call(lambda q, x=x, sc=sc: tf.gemv_fp8(x, q, sc[id(q)]), q8)
            tb = bg.time_per_call(
                lambda q, x=x, sc=sc: tf.gemv_fp8(x, q, sc[id(q)], None, block), qb
            )
            for impl, t, nbytes in (
                ("bf16 gemv", t16, 2 * n * k),
                ("fp8 gemv row", t8, n * k),
                ("fp8 gemv block", tb, n * k),
            ):
                gbps = nbytes / t / 1e9
                rows.append(
                    dict(shape=name, m=m, impl=impl, us=t * 1e6, gbps=gbps,
                         pct_copy=gbps / copy_gbps, vs_bf16=t16 / t)
                )  # fmt: skip
                print(
                    f"{name:8s} M={m} {impl:15s} {t * 1e6:8.2f} us {gbps:7.0f} GB/s "
                    f"{100 * gbps / copy_gbps:5.1f}% copy  {t16 / t:5.2f}x bf16"
                )
        for m in (16, 64, 128, 512, 4096):
            x = torch.randn(m, k, device="cuda").to(bf)
            t16 = bg.time_per_call(lambda w, x=x: F.linear(x, w), w16)
            tb = bg.time_per_call(
                lambda q, x=x, sc=sc: tf.gemm_fp8(x, q, sc[id(q)], None, block), qb
            )
            tr = bg.time_per_call(lambda q, x=x, sc=sc: tf.gemm_fp8(x, q, sc[id(q)]), q8)
            for impl, t in (("cuBLAS bf16", t16), ("fp8 gemm block", tb), ("fp8 gemm row", tr)):
                tflops = 2 * m * n * k / t / 1e12
                rows.append(
                    dict(shape=name, m=m, impl=impl, us=t * 1e6, tflops=tflops, vs_bf16=t16 / t)
                )
                print(
                    f"{name:8s} M={m} {impl:15s} {t * 1e6:8.2f} us {tflops:7.1f} TFLOP/s "
                    f"{t16 / t:5.2f}x cuBLAS"
                )
        del w16, w8, wb, sc, q8, qb
        torch.cuda.empty_cache()
    path = write_record(
        "fp8-kernels", model_shape="qwen3-8b", figures={"copy_gbps": copy_gbps, "rows": rows},
        device="cuda", config=offline.vars_of(args), out_dir=args.out_dir,
    )  # fmt: skip
    print(f"record: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config-dir", default="bench/configs/qwen3-8b")
    parser.add_argument("--shape", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--out-dir", default="bench/records")
    parser.add_argument(
        "--kernels", action="store_true", help="time the projections alone (see the docstring)"
    )
    parser.add_argument(
        "--block", action=argparse.BooleanOptionalAction, default=True,
        help="also measure --quantization fp8-block (128x128 scales, FP8 checkpoints' layout)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("bench_fp8: needs a CUDA device", file=sys.stderr)
        return 1
    if args.kernels:
        return _kernels(args)
    bf16 = _measure(args, None)
    fp8 = _measure(args, "fp8")
    block = _measure(args, "fp8-block") if args.block else None
    speedup = fp8["tok_s"] / bf16["tok_s"]
    bars = {
        "fp8_roofline_ratio": fp8["roofline_ratio"],
        "fp8_roofline_bar": ROOFLINE_BAR,
        "fp8_roofline_pass": fp8["roofline_ratio"] >= ROOFLINE_BAR,
        "fp8_vs_bf16": speedup,
        "fp8_vs_bf16_bar": SPEEDUP_BAR,
        "fp8_vs_bf16_pass": speedup >= SPEEDUP_BAR,
        "kv_blocks_ratio": fp8["kv_blocks"] / bf16["kv_blocks"],
    }
    if block is not None:  # not a bar: what an FP8 checkpoint's layout runs at
        bars["fp8_block_roofline_ratio"] = block["roofline_ratio"]
        bars["fp8_block_vs_bf16"] = block["tok_s"] / bf16["tok_s"]
    shape = args.shape or Path(args.config_dir).name
    path = write_record(
        "fp8-latency", model_shape=shape,
        figures={"bf16": bf16, "fp8": fp8, "fp8_block": block, "bars": bars},
        device=args.device, config=offline.vars_of(args), out_dir=args.out_dir,
        notes="batch-1 decode, random weights; fp8 = --quantization fp8 (per-channel scales), "
        "fp8_block = --quantization fp8-block (128x128 scales)",
    )  # fmt: skip
    for name, figures in (("bf16", bf16), ("fp8", fp8), ("block", block)):
        if figures is None:
            continue
        print(
            f"{name:5s} {figures['tok_s']:8.1f} tok/s  roofline {figures['roofline_tok_s']:8.1f} "
            f"({figures['roofline_ratio']:.2f})  step {figures['step_ms_median']:.3f} ms  "
            f"weights {figures['weights_bytes'] / 2**30:.2f} GiB  KV blocks {figures['kv_blocks']}"
            f"  [{figures['weight_dtype']}]"
        )
    print(json.dumps(bars, indent=2))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
