"""Where a constrained decode step's time goes (issue 17): a timeline of the engine's own
steps under the structured-output bench's tool-call schema, phase by phase.

    PYTHONPATH=. python3 tools/structured_phases.py [--config-dir bench/configs/qwen3-8b]
        [--device cuda] [--batch 64] [--steps 200] [--unconstrained] [--temperature T]
        [--chunks N] [--fill-threads N] [--profile] [--plain-step]

The bench's own loop runs (`metrale.bench.structured.engine_step_cost`: the same requests,
a finished one replaced, the same steps kept: fed steps after a fed step, past the warm-up),
so its figure is the record's. Printed: the kept steps' interval between `engine.step()`
returns, split into the step itself and the time outside it (the bench's loop: replacing
finished requests), with and without a finished request in the step; for each main-thread
phase (the engine's methods, wrapped with any signature) the median start and duration
from the step's start; for the worker threads, the median of each step's matcher accepts
(`GrammarState.sync_many`) and rows filled ahead (`grammar_rows.prefill_rows`), summed over
the chunks and as the longest chunk. Writes nothing (a profiling tool, not a benchmark:
the timers cost a little).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.bench import structured
from metrale.bench.synthetic import prepare_model_dir
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.sampling import grammar, grammar_advance
from metrale.sampling.grammar import GrammarState

MAIN_PHASES = (
    "_forward_step", "_read_back", "_advance_grammars_async", "_emit", "_outputs",
    "_finish_terminated", "_sample_step",
)  # fmt: skip


class Timeline:
    """Phase intervals of the current step, relative to its start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.main: list[tuple[str, float, float]] = []
        self.worker: list[tuple[str, int, float, float]] = []
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.main, self.worker = [], []

    def timed(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                if threading.current_thread() is threading.main_thread():
                    self.main.append((name, begin - self.start, end - self.start))
                else:
                    with self.lock:
                        self.worker.append(
                            (name, threading.get_ident(), begin - self.start, end - self.start)
                        )

        return wrapper


def instrument(timeline: Timeline) -> None:
    for name in MAIN_PHASES:
        setattr(Engine, name, timeline.timed(name, getattr(Engine, name)))
    Future.result = timeline.timed("wait: grammar work", Future.result)  # type: ignore[method-assign]
    GrammarState.sync_many = staticmethod(timeline.timed("sync_many", GrammarState.sync_many))  # type: ignore[method-assign]
    grammar_advance.prefill_rows = timeline.timed("prefill_rows", grammar_advance.prefill_rows)


def run(args: argparse.Namespace) -> None:
    if args.chunks is not None:  # before the engine builds its grammar backend
        grammar.ADVANCE_CHUNKS = args.chunks
        grammar_advance.MIN_CHUNK_ROWS = max(1, args.batch // args.chunks)
    if args.fill_threads is not None:
        grammar.BATCH_FILL_THREADS = args.fill_threads
    model_dir = prepare_model_dir(args.config_dir)
    vocab = int(json.loads((Path(args.config_dir) / "config.json").read_text())["vocab_size"])
    engine = Engine(
        EngineConfig(
            model=str(model_dir), tokenizer=str(structured.stdlib_tokenizer(vocab)),
            device=args.device, load_format="dummy", max_num_seqs=args.batch,
            max_model_len=args.context + args.steps + 64, enable_prefix_caching=False,
        )
    )  # fmt: skip
    timeline = Timeline()
    instrument(timeline)
    steps: list[StepRecord] = []
    step = Engine.step

    def recorded(self: Engine, *a: Any, **k: Any) -> Any:
        fed, late = self.fed_steps, self.late_sampled_steps
        timeline.reset()
        outputs = step(self, *a, **k)
        steps.append(
            StepRecord(
                timeline.start, time.perf_counter(), self.fed_steps > fed,
                self.late_sampled_steps > late, sum(o.finished for o in outputs),
                list(timeline.main), list(timeline.worker),
            )
        )  # fmt: skip
        return outputs

    Engine.step = recorded  # type: ignore[method-assign]
    # The bench's own loop (a finished request is replaced; the same warm-up and the same
    # steps kept), so the figures here are the record's, split by phase.
    profiler = cProfile.Profile() if args.profile else None
    figures = structured.engine_step_cost(
        engine, args.batch, not args.unconstrained, args.temperature, args.context, args.steps,
        profiler, stream_outputs=not args.plain_step,
    )  # fmt: skip
    print(f"bench figure: step_ms_median {figures['step_ms_median']:.3f}")
    report(steps)
    if profiler is not None:
        stats = pstats.Stats(profiler).sort_stats("cumulative")
        stats.print_stats(args.profile_filter, 40)


@dataclass
class StepRecord:
    start: float
    end: float
    fed: bool
    late: bool
    finished: int
    main: list[tuple[str, float, float]]
    worker: list[tuple[str, int, float, float]]


def report(steps: list[StepRecord]) -> None:
    """The bench's kept steps (fed, after a fed step, past the 8 warm-up fed steps): the
    interval between step returns split into the step and the time outside it, then the
    main-thread phases and the worker chunks of those steps."""
    kept: list[tuple[float, StepRecord]] = []
    taken = 0
    for i, rec in enumerate(steps):
        taken += rec.fed
        before = steps[i - 1] if i else None
        if rec.fed and before is not None and before.fed and taken > 8:
            kept.append((rec.end - before.end, rec))
    if not kept:
        print("no steady steps kept")
        return
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    late = sum(r.late for _, r in kept)
    print(
        f"{len(kept)} kept of {len(steps)} steps ({late} late-sampled); interval median "
        f"{ms([i for i, _ in kept]):.3f} ms, mean {1e3 * statistics.fmean(i for i, _ in kept):.3f}"
        f"; step() {ms([r.end - r.start for _, r in kept]):.3f} ms; outside "
        f"{ms([i - (r.end - r.start) for i, r in kept]):.3f} ms"
    )
    for label, group in (
        ("with a finished request", [k for k in kept if k[1].finished]),
        ("without", [k for k in kept if not k[1].finished]),
    ):
        print(
            f"  {label}: {len(group)} steps, interval median {ms([i for i, _ in group]):.3f}"
            f" ms, step() {ms([r.end - r.start for _, r in group]):.3f} ms"
        )
    starts: dict[str, list[float]] = defaultdict(list)
    spans: dict[str, list[float]] = defaultdict(list)
    for _, rec in kept:
        seen: dict[str, tuple[float, float]] = {}
        for name, begin, end in rec.main:
            first, length = seen.get(name, (begin, 0.0))
            seen[name] = (first, length + end - begin)
        for name, (first, length) in seen.items():
            starts[name].append(first)
            spans[name].append(length)
    print(f"{'main-thread phase':32s} {'start ms':>9s} {'time ms':>9s} {'in steps':>8s}")
    for name in sorted(starts, key=lambda n: statistics.median(starts[n])):
        print(f"{name:32s} {ms(starts[name]):9.3f} {ms(spans[name]):9.3f} {len(starts[name]):8d}")
    for name in ("sync_many", "prefill_rows"):
        summed, longest, ends = [], [], []
        for _, rec in kept:
            parts = [(end - begin, end) for n, _, begin, end in rec.worker if n == name]
            if parts:
                summed.append(sum(p for p, _ in parts))
                longest.append(max(p for p, _ in parts))
                ends.append(max(e for _, e in parts))
        print(
            f"worker {name:14s} summed {ms(summed):.3f} ms, longest chunk {ms(longest):.3f} "
            f"ms, last chunk ends at {ms(ends):.3f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-dir", default="bench/configs/qwen3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--unconstrained", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chunks", type=int, help="grammar.ADVANCE_CHUNKS for this run")
    parser.add_argument(
        "--plain-step", action="store_true",
        help="engine.step() without on_outputs (every output returned at the step's end)",
    )  # fmt: skip
    parser.add_argument("--fill-threads", type=int, help="grammar.BATCH_FILL_THREADS for this run")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the main thread over the timed steps"
    )
    parser.add_argument(
        "--profile-filter", default=".", help="regex of the profile rows printed (by cumulative)"
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
