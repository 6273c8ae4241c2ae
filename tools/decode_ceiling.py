"""The engine's decode ceiling at C concurrent sequences, without any server: C requests of
`--isl` random tokens decode `--osl` tokens each; prints steady-state decode tok/s and splits a
step's wall time into the forward + sampler (GPU time by CUDA events) and the host parts.
Under async scheduling (the default) a step's host work overlaps the previous step's GPU time.

Usage (on a GPU machine, from the repository root):
    PYTHONPATH=. python3 tools/decode_ceiling.py bench/configs/qwen3-8b --concurrency 128 \
        [--temperature 0.8 --top-p 0.95 --top-k 50] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from metrale import Engine, EngineConfig, SamplingParams
from metrale.bench.synthetic import prepare_model_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config_dir")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=384)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile 50 steady decode steps")
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (default 0: greedy)")  # fmt: skip
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    args = parser.parse_args()
    c = args.concurrency
    engine = Engine(
        EngineConfig(
            model=str(prepare_model_dir(args.config_dir)), load_format="dummy",
            max_model_len=2048, max_num_seqs=c, enable_prefix_caching=False,
            async_scheduling=not args.no_async_scheduling,
        )
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for i in range(c):
        prompt = torch.randint(10, engine.vocab_size - 10, (args.isl,), generator=gen).tolist()
        engine.add_request(
            f"r{i}",
            prompt,
            SamplingParams(
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                max_tokens=args.osl,
                ignore_eos=True,
            ),
        )
    model_forward = engine._forward_step
    sampler = engine.sampler

    cuda = engine.model.device.type == "cuda"

    def timed_forward(plan, previous):  # type: ignore[no-untyped-def]
        if not cuda:  # CPU smoke run: wall time stands in for device time
            t = time.perf_counter()
            out = model_forward(plan, previous)
            timed_forward.events.append(1000 * (time.perf_counter() - t))
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model_forward(plan, previous)
        end.record()
        timed_forward.events.append((start, end))
        return out

    timed_forward.events = []  # type: ignore[attr-defined]
    engine._forward_step = timed_forward  # type: ignore[method-assign]

    host_ms: dict[str, list[float]] = {
        "schedule": [], "plan_fed": [], "forward_call": [], "sample_launch": [],
        "readback_and_commit": [],
    }  # fmt: skip

    def timed(name, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = fn(*a, **k)
            host_ms[name].append(1000 * (time.perf_counter() - t))
            return out

        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.sampler.sample = timed("sample_launch", sampler.sample)  # type: ignore[method-assign]
    engine._commit = timed("readback_and_commit", engine._commit)  # type: ignore[method-assign]
    engine.scheduler.plan_fed_step = timed("plan_fed", engine.scheduler.plan_fed_step)  # type: ignore[method-assign]
    engine._forward = timed("forward_call", engine._forward)  # type: ignore[method-assign]
    engine.model.decode_batch_fed = timed("forward_call", engine.model.decode_batch_fed)  # type: ignore[method-assign]
    step_ms: list[float] = []
    tokens = 0
    decode_steps = 0
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    while engine.has_unfinished():
        if profiler is not None and decode_steps == 100:
            profiler.enable()
        if profiler is not None and decode_steps == 150:
            profiler.disable()
        running = len(engine.scheduler.running)
        t = time.perf_counter()
        outputs = engine.step()
        dt = 1000 * (time.perf_counter() - t)
        all_decoding = running == c and all(
            len(s.output_token_ids) > 0 for s in engine.scheduler.running
        )
        if all_decoding and len(outputs) == c:
            step_ms.append(dt)
            tokens += c
            decode_steps += 1
    events = timed_forward.events[-decode_steps:]  # type: ignore[attr-defined]
    if cuda:
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for s, e in events]
    else:
        gpu = list(events)
    wall = sum(step_ms) / 1000
    result = {
        "concurrency": c,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
        "decode_tok_s": tokens / wall if wall else 0.0,
        "step_ms_median": statistics.median(step_ms),
        "launch_gpu_ms_median": statistics.median(gpu),
        "decode_steps": decode_steps,
        **{f"{k}_ms_median": statistics.median(v[-decode_steps:]) for k, v in host_ms.items() if v},
        "fed_steps": engine.fed_steps,
        "drained_steps": engine.drained_steps,
        "graph_forwards": getattr(getattr(engine.model, "graph_runner", None), "replays", 0),
    }
    print(json.dumps(result, indent=1))
    if profiler is not None and decode_steps > 150:
        import pstats

        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
