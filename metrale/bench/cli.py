"""`metrale bench <instrument>`: the benchmark instruments.

Owner: bench. Each instrument writes one JSON record under `bench/records/` and prints a table.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    from metrale.bench import ttft

    bench = sub.add_parser("bench", help="run a benchmark instrument and write its record")
    inner = bench.add_subparsers(dest="instrument", required=True)
    p = inner.add_parser("ttft", help="time to first token, cold vs prefix-cached")
    ttft.add_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(handler=lambda args: _run(ttft.run, args))


def _run(fn: Any, args: argparse.Namespace) -> int:
    fn(args)
    return 0
