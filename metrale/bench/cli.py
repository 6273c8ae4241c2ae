"""`metrale bench <instrument>`: the benchmark instruments.

Owner: bench. Each instrument writes one JSON record under `bench/records/` and prints a table.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    from metrale.bench import offline, serve, spec, ttft

    bench = sub.add_parser("bench", help="run a benchmark instrument and write its record")
    inner = bench.add_subparsers(dest="instrument", required=True)
    p = inner.add_parser("ttft", help="time to first token, cold vs prefix-cached")
    ttft.add_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(handler=lambda args: _run(ttft.run, args))
    p = inner.add_parser("latency", help="batch-1 decode tok/s vs the HBM roofline and HF")
    offline.add_latency(p)
    p.set_defaults(handler=lambda args: _run(offline.run_latency, args))
    p = inner.add_parser("throughput", help="offline throughput, the nano-vllm recipe")
    offline.add_throughput(p)
    p.set_defaults(handler=lambda args: _run(offline.run_throughput, args))
    p = inner.add_parser("spec", help="speculative decoding on held-out code: ngram, suffix vs off")
    spec.add_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(handler=lambda args: _run(spec.run, args))
    p = inner.add_parser("spec-cost", help="verify step cost vs decode, projected/measured speedup")
    spec.add_cost_arguments(p)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=lambda args: _run(spec.run_cost, args))
    p = inner.add_parser("serve", help="concurrency ladder against an OpenAI-compatible URL")
    serve.add_arguments(p)
    p.set_defaults(handler=lambda args: _run(serve.run, args))


def _run(fn: Any, args: argparse.Namespace) -> int:
    fn(args)
    return 0
