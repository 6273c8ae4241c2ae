"""Where a constrained decode step's time goes (issue 17): a timeline of the engine's own
steps under the structured-output bench's tool-call schema, phase by phase.

    PYTHONPATH=. python3 tools/structured_phases.py [--config-dir bench/configs/qwen3-8b]
        [--device cuda] [--batch 64] [--steps 200] [--unconstrained]

Only the late-sampled steps that follow another late-sampled step are kept (the steady
pipeline: the forward is fed on the device, then the step before is read back, the
grammar work runs on the worker threads while the outputs are built, then the sampler is
queued). For each main-thread phase (the engine's methods, wrapped with any signature) the
median start and duration from the step's start; for the worker threads, the median of each
step's matcher accepts (`GrammarState.sync_many`) and rows filled ahead
(`GrammarState.prefill_rows`), summed over the chunks and as the longest chunk. Prints a
table; writes nothing (a profiling tool, not a benchmark: the timers cost a little).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from metrale.bench import structured
from metrale.bench.synthetic import prepare_model_dir
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.sampling.grammar import GrammarState
from metrale.sampling.params import SamplingParams
from metrale.sampling.structured import GrammarSpec

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
    for name in ("sync_many", "prefill_rows"):
        setattr(GrammarState, name, staticmethod(timeline.timed(name, getattr(GrammarState, name))))


def run(args: argparse.Namespace) -> None:
    model_dir = prepare_model_dir(args.config_dir)
    vocab = int(json.loads((Path(args.config_dir) / "config.json").read_text())["vocab_size"])
    engine = Engine(
        EngineConfig(
            model=str(model_dir), tokenizer=str(structured.stdlib_tokenizer(vocab)),
            device=args.device, load_format="dummy", max_num_seqs=args.batch,
            max_model_len=args.context + args.steps + 64, enable_prefix_caching=False,
        )
    )  # fmt: skip
    spec = None if args.unconstrained else GrammarSpec.json_schema(structured.TOOL_CALL_SCHEMA, "b")
    params = SamplingParams(
        temperature=0.0, max_tokens=args.steps + 16, ignore_eos=True, structured_outputs=spec
    )
    gen = torch.Generator().manual_seed(1)
    count = iter(range(10**9))

    def submit() -> None:
        prompt = torch.randint(8, min(vocab, 1000), (args.context,), generator=gen).tolist()
        engine.add_request(f"p{next(count)}", prompt, params)

    for _ in range(args.batch):
        submit()
    timeline = Timeline()
    instrument(timeline)
    kept: list[tuple[float, list[Any], list[Any]]] = []
    previous_late = False
    for step in range(args.steps + 10):
        late_before = engine.late_sampled_steps
        fed_before = engine.fed_steps
        timeline.reset()
        outputs = engine.step()
        total = time.perf_counter() - timeline.start
        late = engine.late_sampled_steps > late_before
        steady = engine.fed_steps > fed_before and (late or args.unconstrained)
        if step >= 10 and steady and (previous_late or args.unconstrained):
            kept.append((total, list(timeline.main), list(timeline.worker)))
        previous_late = steady
        for out in outputs:
            if out.finished:
                submit()
    report(kept)


def report(kept: list[tuple[float, list[Any], list[Any]]]) -> None:
    if not kept:
        print("no steady steps kept")
        return
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    print(f"{len(kept)} steady steps; step median {ms([k[0] for k in kept]):.3f} ms")
    starts: dict[str, list[float]] = defaultdict(list)
    spans: dict[str, list[float]] = defaultdict(list)
    for _, main, _ in kept:
        seen: dict[str, tuple[float, float]] = {}
        for name, begin, end in main:
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
        for _, _, worker in kept:
            parts = [(end - begin, end) for n, _, begin, end in worker if n == name]
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
    run(parser.parse_args())


if __name__ == "__main__":
    main()
