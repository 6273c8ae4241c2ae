"""Multi-LoRA kernel microbenchmark: each group op of one decoder layer (q/k/v, o, gate/up,
down) on Qwen3-8B shapes, rank 16, rows spread over 8 adapters, in every form the engine can
run, old (the per-row split gather every graph ran before) against new (fused for few rows,
grouped by slot for many).

Usage (CUDA; a minute or two on an H200, Triton compilation included):
    PYTHONPATH=. python tools/bench_lora_kernels.py --out $OUT/lora_kernels.json
A CPU smoke run of the same code (Triton's interpreter, shapes divided by 16, timings
meaningless): `TRITON_INTERPRET=1 PYTHONPATH=. python tools/bench_lora_kernels.py --scale 16
--rows 1,8 --layers 1`.

Method:
- `--layers` copies (default 36, Qwen3-8B's depth) of each group's slot stacks (8 slots of
  rank 16), so, as in a decode step, no call finds its adapters in L2 from the previous call.
  Row t uses slot `t % adapters` (every adapter present once rows >= adapters).
- Each (group, rows, form) is timed as a CUDA-graph replay of one call per layer copy, back to
  back (programmatic dependent launches where the engine uses them: the gather forms), the
  median of several replays divided by the layer count: microseconds per group op.
- Forms: `split` (old: split-K shrink + expand per row), `fused` (one launch per group, each
  of `--fused-programs` programs per row repeating the shrink), `sync` (one launch per group:
  K splits, a grid barrier, column blocks; timed last, its counters checked after),
  `grouped` (the tiled op over
  the device plan's 16-row tiles; the plan itself, one launch per forward, is timed apart as
  `plan`), and `auto`, what the engine now picks at that row count (`PLAN_MIN_ROWS`,
  `FUSED_MAX_ROWS`). Every form is first checked against the float32 torch reference
  (`lora_reference.lora_gather_add`; max abs error reported).
- The summary gives, per rows and form, the layer's four ops summed and that times
  `--layers` (plus the plan for `grouped`): the LoRA cost of one decode step.
- Whole groups (`--group-rows`, default 1,2,4: the GEMV's rows, and one count where the base
  projection is cuBLAS, `triton_linear.EPILOGUE_MAX_ROWS`'s question), each a base projection with
  its deltas, timed the same way over `--base-copies` copies of the base weights (so W
  streams from HBM, as in a decode step): `base` (the projection alone: `linear`, or
  `silu_mul_linear` for down), `group/split` (what the graphs ran before: the projection,
  then the split shrink and expand; down: SiLU-and-mul materialised, its projection, the
  split pair) and `group/epilogue` (`lora_linear`'s epilogue form: the shrink, then the
  GEMV adding the expand as it stores; down: the shrink of silu(gate) * up, then
  `gemv_silu_mul` with the epilogue). Checked against the float32 reference first. Its
  summary gives each form's layer and step time and its LoRA overhead over `base`.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from metrale.kernels import lora_reference
from metrale.layers.lora import PLAN_MIN_ROWS

#: Qwen3-8B: hidden 4096, intermediate 12288, 32 query heads and 8 KV heads of 128.
GROUPS: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (12288, 12288)),
    "down": (12288, (4096,)),
}
REPLAYS = 20


def _timed(fn: Callable[[int], None], layers: int, cuda: bool) -> float:
    """Microseconds per call of `fn(layer)`: a graph of one call per layer, median replay."""
    if not cuda:  # interpreter smoke run: wall clock of one pass, meaningless as a figure
        start = time.perf_counter()
        for i in range(layers):
            fn(i)
        return (time.perf_counter() - start) / layers * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up off the capture
        for i in range(layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / layers)
    del graph
    return statistics.median(times)


def _forms(
    stacks: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, y: torch.Tensor,
    token_slots: torch.Tensor, scales: torch.Tensor, widths: tuple[int, ...],
    tiles: torch.Tensor, order: torch.Tensor, pdl: bool, programs: list[int],
    sync: torch.Tensor | None,
) -> dict[str, Callable[[int], None]]:  # fmt: skip
    """Each form of one group op as `fn(layer)` over that layer's copy of the stacks."""
    from metrale.kernels import triton_lora, triton_lora_tiles

    def split(i: int) -> None:
        a, b_t = stacks[i]
        triton_lora.lora_gather_add(
            y, x, a, b_t, token_slots, scales, widths, pdl=pdl, form="split"
        )

    def grouped(i: int) -> None:
        a, b_t = stacks[i]
        triton_lora_tiles.lora_tiles_add(y, x, a, b_t, tiles, scales, widths, order=order, pdl=pdl)

    def fused(i: int, p: int) -> None:
        a, b_t = stacks[i]
        triton_lora.lora_gather_add(
            y, x, a, b_t, token_slots, scales, widths, pdl=pdl, form="fused", fused_programs=p
        )

    forms: dict[str, Callable[[int], None]] = {"split": split, "grouped": grouped}
    for p in programs:
        forms[f"fused/{p}"] = functools.partial(fused, p=p)
    if sync is not None:  # last: a broken barrier would cost the most here

        def synced(i: int) -> None:
            a, b_t = stacks[i]
            triton_lora.lora_gather_add(
                y, x, a, b_t, token_slots, scales, widths, pdl=pdl, form="sync", sync=sync
            )

        forms[f"sync/{triton_lora.SYNC_PROGRAMS}"] = synced
    return forms


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from metrale.kernels import triton_lora, triton_lora_tiles

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    pdl = cuda and torch.cuda.get_device_capability()[0] >= 9 and not args.no_pdl
    torch.manual_seed(0)
    rank, adapters, layers = args.rank, args.adapters, args.layers
    rows_list = [int(r) for r in args.rows.split(",")]
    programs_list = [int(p) for p in args.fused_programs.split(",")]
    results: list[dict[str, Any]] = []
    plan_us: dict[int, float] = {}
    sync = torch.zeros(4, dtype=torch.int32, device=device) if cuda and not args.no_sync else None
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
    shapes = {
        name: (fan_in // args.scale, tuple(w // args.scale for w in widths))
        for name, (fan_in, widths) in GROUPS.items()
    }
    # Per group, one copy of the 8 slots' stacks per layer (made once, on the device).
    all_stacks = {
        name: [
            (
                torch.randn(adapters, len(widths), rank, fan_in, device=device).to(dtype) * 0.02,
                torch.randn(adapters, rank, sum(widths), device=device).to(dtype) * 0.02,
            )
            for _ in range(layers)
        ]
        for name, (fan_in, widths) in shapes.items()
    }
    print(f"{'group':<8} {'rows':>4} {'form':<12} {'us/op':>8} {'max err':>9}", flush=True)
    for rows in rows_list:
        token_slots = (torch.arange(rows) % adapters).to(device)
        order, tiles = triton_lora_tiles.lora_plan(
            token_slots, adapters, lora_reference.LORA_PLAN_ROWS
        )
        want_order, want_tiles = lora_reference.lora_plan(
            token_slots.cpu(), adapters, lora_reference.LORA_PLAN_ROWS
        )
        if not (torch.equal(order.cpu(), want_order) and torch.equal(tiles.cpu(), want_tiles)):
            raise SystemExit(f"lora_plan differs from its reference at {rows} rows")
        plan_us[rows] = _timed(
            lambda _i, s=token_slots: triton_lora_tiles.lora_plan(
                s, adapters, lora_reference.LORA_PLAN_ROWS
            ),
            layers,
            cuda,
        )
        print(f"{'-':<8} {rows:>4} {'plan':<12} {plan_us[rows]:>8.2f}", flush=True)
        for name, (fan_in, widths) in shapes.items():
            stacks = all_stacks[name]
            scales = torch.full((adapters, len(widths)), 2.0, device=device)
            x = torch.randn(rows, fan_in, device=device).to(dtype)
            y = torch.randn(rows, sum(widths), device=device).to(dtype)
            forms = _forms(
                stacks, x, y, token_slots, scales, widths, tiles, order, pdl, programs_list,
                sync if rows * triton_lora.SYNC_PROGRAMS <= sms else None,
            )  # fmt: skip
            for form, fn in forms.items():
                if form.startswith(("fused", "sync")) and rows > args.fused_max_rows:
                    continue
                ref = y.float().clone()
                a0, b0 = stacks[0]
                lora_reference.lora_gather_add(
                    ref, x.float(), a0.float(), b0.float(), token_slots, scales, widths
                )
                saved = y.clone()
                fn(0)
                err = float((y.float() - ref).abs().max())
                us = _timed(fn, layers, cuda)
                y.copy_(saved)
                if form.startswith("sync") and sync is not None and sync.tolist() != [0] * 4:
                    raise SystemExit(
                        f"sync form: counters left at {sync.tolist()} (timeout flag 3rd)"
                    )
                few = (
                    f"sync/{triton_lora.SYNC_PROGRAMS}"
                    if triton_lora.FEW_ROWS_FORM == "sync"
                    else f"fused/{triton_lora.FUSED_PROGRAMS}"
                )
                auto = (
                    "grouped"
                    if rows >= PLAN_MIN_ROWS
                    else (few if rows <= triton_lora.FUSED_MAX_ROWS else "split")
                )
                results.append(
                    {"group": name, "rows": rows, "form": form, "us": us, "max_err": err,
                     "auto": form == auto}
                )  # fmt: skip
                mark = " (auto)" if form == auto else ""
                print(f"{name:<8} {rows:>4} {form + mark:<12} {us:>8.2f} {err:>9.2e}", flush=True)
    summary = []
    print(f"\nper layer (4 ops) and per decode step ({layers} layers; grouped: + plan)")
    for rows in rows_list:
        forms = sorted({r["form"] for r in results if r["rows"] == rows})
        for form in forms:
            ops = [r for r in results if r["rows"] == rows and r["form"] == form]
            if len(ops) != len(GROUPS):
                continue
            layer_us = sum(r["us"] for r in ops)
            step_us = layer_us * layers + (plan_us[rows] if form == "grouped" else 0.0)
            auto = all(r["auto"] for r in ops)
            summary.append(
                {"rows": rows, "form": form, "layer_us": layer_us, "step_us": step_us,
                 "auto": auto}
            )  # fmt: skip
            mark = " (auto)" if auto else ""
            print(
                f"rows {rows:>3} {form + mark:<14} layer {layer_us:8.2f} us  step {step_us:9.1f} us"
            )
    group_results, group_summary = _bench_groups(args, shapes, all_stacks, device, dtype, pdl)
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "dtype": str(dtype),
        "rank": rank,
        "adapters": adapters,
        "layers": layers,
        "scale": args.scale,
        "pdl": pdl,
        "plan_min_rows": PLAN_MIN_ROWS,
        "fused_max_rows": triton_lora.FUSED_MAX_ROWS,
        "fused_programs_default": triton_lora.FUSED_PROGRAMS,
        "few_rows_form": triton_lora.FEW_ROWS_FORM,
        "sync_programs": triton_lora.SYNC_PROGRAMS,
        "plan_us": plan_us,
        "ops": results,
        "summary": summary,
        "groups": group_results,
        "group_summary": group_summary,
    }


def _group_forms(
    weights: list[torch.Tensor], stacks: list[tuple[torch.Tensor, torch.Tensor]],
    scales: torch.Tensor, widths: tuple[int, ...], act: bool, x: torch.Tensor,
    token_slots: torch.Tensor, pdl: bool,
) -> dict[str, Callable[[int], torch.Tensor]]:  # fmt: skip
    """One group's forms as `fn(layer)`: `base`, `group/split`, `group/epilogue`."""
    from metrale.kernels import triton_linear, triton_lora, triton_norm

    def base(i: int) -> torch.Tensor:
        w = weights[i % len(weights)]
        if act:
            return triton_linear.silu_mul_linear(x, w, None, pdl=pdl)
        return triton_linear.linear(x, w, None, pdl=pdl)

    def split(i: int) -> torch.Tensor:
        w, (a, b_t) = weights[i % len(weights)], stacks[i]
        inp = triton_norm.silu_and_mul(x) if act else x
        y = triton_linear.linear(inp, w, None, pdl=pdl)
        triton_lora.lora_gather_add(
            y, inp, a, b_t, token_slots, scales, widths, pdl=pdl, form="split"
        )
        return y

    def epilogue(i: int) -> torch.Tensor:
        w, (a, b_t) = weights[i % len(weights)], stacks[i]
        return triton_linear.lora_linear(
            x, w, None, a, b_t, token_slots, scales, widths, act=act, pdl=pdl, form="epilogue"
        )

    return {"base": base, "group/split": split, "group/epilogue": epilogue}


def _bench_groups(
    args: argparse.Namespace, shapes: dict[str, tuple[int, tuple[int, ...]]],
    all_stacks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]], device: torch.device,
    dtype: torch.dtype, pdl: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """Whole groups (a base projection and its deltas) per form; see the module docstring."""
    from metrale.kernels import reference

    cuda = device.type == "cuda"
    layers, adapters = args.layers, args.adapters
    rows_list = [int(r) for r in args.group_rows.split(",") if r]
    results: list[dict[str, Any]] = []
    if not rows_list:
        return results, []
    print(f"\n{'group':<8} {'rows':>4} {'form':<15} {'us/group':>9} {'max err':>9}", flush=True)
    for name, (fan_in, widths) in shapes.items():
        act = name == "down"
        weights = [
            torch.randn(sum(widths), fan_in, device=device).to(dtype) * 0.02
            for _ in range(args.base_copies)
        ]
        stacks = all_stacks[name]
        scales = torch.full((adapters, len(widths)), 2.0, device=device)
        for rows in rows_list:
            token_slots = (torch.arange(rows) % adapters).to(device)
            x = torch.randn(rows, (2 if act else 1) * fan_in, device=device).to(dtype)

            forms = _group_forms(weights, stacks, scales, widths, act, x, token_slots, pdl)
            inp = reference.silu_and_mul(x.float()) if act else x.float()
            ref = inp @ weights[0].float().T
            a0, b0 = stacks[0]
            lora_reference.lora_gather_add(
                ref, inp, a0.float(), b0.float(), token_slots, scales, widths
            )
            for form, fn in forms.items():
                err = float("nan") if form == "base" else float((fn(0).float() - ref).abs().max())
                us = _timed(fn, layers, cuda)
                results.append({"group": name, "rows": rows, "form": form, "us": us,
                                "max_err": err})  # fmt: skip
                print(f"{name:<8} {rows:>4} {form:<15} {us:>9.2f} {err:>9.2e}", flush=True)
    summary: list[dict[str, Any]] = []
    print(f"\nwhole groups per layer (4) and per decode step ({layers} layers)")
    for rows in rows_list:
        layer_us = {
            form: sum(r["us"] for r in results if r["rows"] == rows and r["form"] == form)
            for form in ("base", "group/split", "group/epilogue")
        }
        for form, us in layer_us.items():
            over = us - layer_us["base"]
            summary.append({"rows": rows, "form": form, "layer_us": us, "step_us": us * layers,
                            "lora_layer_us": over, "lora_step_us": over * layers})  # fmt: skip
            print(f"rows {rows:>3} {form:<15} layer {us:8.2f} us  step {us * layers:9.1f} us  "
                  f"LoRA over base: layer {over:7.2f} us, step {over * layers:8.1f} us")  # fmt: skip
    return results, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--rows", default="1,8,64", help="token rows (comma-separated)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8, help="slots; row t uses t %% this")
    parser.add_argument("--layers", type=int, default=36, help="copies of the stacks timed")
    parser.add_argument(
        "--fused-programs", default="8,16,32", help="programs per row of the fused form to try"
    )
    parser.add_argument(
        "--fused-max-rows", type=int, default=8, help="time the fused form up to these rows"
    )
    parser.add_argument(
        "--group-rows", default="1,2,4", help="rows of the whole-group timing ('' skips it)"
    )
    parser.add_argument(
        "--base-copies", type=int, default=4, help="copies of each group's base weights"
    )
    parser.add_argument("--no-pdl", action="store_true", help="launch without PDL")
    parser.add_argument("--no-sync", action="store_true", help="skip the sync form")
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension (smoke)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.scale > 1:
        print("needs CUDA (or a --scale > 1 smoke run under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    result = bench(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
