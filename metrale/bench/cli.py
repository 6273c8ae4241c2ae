"""`metrale bench <instrument>`: the benchmark instruments.

Owner: bench. Each instrument writes one JSON record under `bench/records/` and prints a table.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any


def add_bench_parser(sub: Any) -> None:
    from metrale.bench import (
        kv_tiers,
        lora,
        offline,
        plot,
        serve,
        spec,
        spec_cost,
        structured,
        translate,
        ttft,
    )

    bench = sub.add_parser("bench", help="run a benchmark instrument and write its record")
    inner = bench.add_subparsers(dest="instrument", required=True)
    # (name, help, its arguments, its run, the --log-level default when it takes one)
    instruments: list[tuple[str, str, Callable[..., None], Callable[..., Any], str | None]] = [
        ("ttft", "time to first token, cold vs prefix-cached", ttft.add_arguments, ttft.run,
         "WARNING"),
        ("kv-tiers", "TTFT of a prefix from the host / disk KV tiers vs cold; high-speed swap",
         kv_tiers.add_arguments, kv_tiers.run, "WARNING"),
        ("latency", "batch-1 decode tok/s vs the HBM roofline and HF", offline.add_latency,
         offline.run_latency, None),
        ("throughput", "offline throughput, the nano-vllm recipe", offline.add_throughput,
         offline.run_throughput, None),
        ("spec", "speculative decoding on held-out code: ngram, suffix, mtp, draft_model vs off",
         spec.add_arguments, spec.run, "WARNING"),
        ("spec-cost", "verify step cost vs decode, projected/measured speedup",
         spec_cost.add_cost_arguments, spec_cost.run_cost, "INFO"),
        ("structured", "grammar-constrained decode step cost vs unconstrained (tool-call schema)",
         structured.add_arguments, structured.run, "WARNING"),
        ("serve", "concurrency ladder against an OpenAI-compatible URL", serve.add_arguments,
         serve.run, None),
        ("translate", "M2M100/NLLB beam-search sentences/s vs CTranslate2", translate.add_arguments,
         translate.run, "WARNING"),
        ("lora", "multi-LoRA throughput and batch-1 decode against the base model",
         lora.add_arguments, lora.run, "INFO"),
        ("plot", "PNG charts of benchmark records (serve ladder, roofline, history)",
         plot.add_arguments, plot.run, "WARNING"),
    ]  # fmt: skip
    for name, help_text, add_arguments, run, log_level in instruments:
        p = inner.add_parser(name, help=help_text)
        add_arguments(p)
        if log_level is not None:
            p.add_argument("--log-level", default=log_level)
        p.set_defaults(handler=functools.partial(_run, run))


def _run(fn: Any, args: argparse.Namespace) -> int:
    fn(args)
    return 0
