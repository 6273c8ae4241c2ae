"""Host-side costs this project's CPU work is about, measured on this machine in one run and
written as a record ("host-costs-cpu"):

- the engine process's output path at 128 streams: wire deltas built from the request state
  (`DeltaEncoder.encode_state`), pickled, unpickled and rebuilt (`apply_delta`);
- a radix prefix-cache eviction of 8 blocks with ~16k cached blocks;
- the small model's 32 projections by the C GEMV, float32 weights against bfloat16;
- a full garbage collection in a process holding the server's start-up objects (the app over
  an engine process on the tiny model), before and after `gc.freeze()`;
- the bf16 weights' greedy agreement with float32 on a test checkpoint (the fused step).

Usage: PYTHONPATH=. .venv/bin/python tools/host_costs_cpu.py [--tiny-model /tmp/peersm/tiny]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import pickle
import random
import statistics
import time
from typing import Any

import torch

from metrale.bench.record import write_record


def _median_ms(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def output_path(streams: int = 128, tokens: int = 600) -> dict[str, float]:
    from metrale.engine.output import ChoiceState, RequestState
    from metrale.engine.output_delta import Assembly, DeltaEncoder, OutputDelta, apply_delta
    from metrale.sampling.params import SamplingParams

    class Seq:
        num_cached_tokens = 0
        embedding = None

    class Detok:
        def add_tokens(self, ids: list[int]) -> str:
            return "ab"

    states = []
    for r in range(streams):
        state = RequestState(f"cmpl-{r}", None, list(range(128)), SamplingParams(), None)  # type: ignore[arg-type]
        choice = ChoiceState(index=0, seq=Seq(), detokenizer=Detok(), stops=None, logprobs=None)  # type: ignore[arg-type]
        choice.token_ids, choice.text = list(range(tokens)), "ab" * tokens
        state.choices.append(choice)
        state.first_token_time = state.arrival
        states.append(state)
    encoder = DeltaEncoder()
    assemblies = {s.request_id: Assembly(None, None, s.prompt_token_ids) for s in states}  # type: ignore[arg-type]
    for s in states:
        apply_delta(assemblies[s.request_id], OutputDelta.of(encoder.encode_state(s)))
    parts: dict[str, list[float]] = {"encode": [], "pickle": [], "unpickle": [], "apply": []}
    for _ in range(200):
        for s in states:
            s.add_token(s.choices[0], 7, -0.5, 1, None)
        t0 = time.perf_counter()
        deltas = [encoder.encode_state(s) for s in states]
        t1 = time.perf_counter()
        blob = pickle.dumps(("out", deltas, None), protocol=pickle.HIGHEST_PROTOCOL)
        t2 = time.perf_counter()
        message = pickle.loads(blob)
        t3 = time.perf_counter()
        for d in message[1]:
            apply_delta(assemblies[d[0]], OutputDelta.of(d))
        t4 = time.perf_counter()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[key].append(dt)
    return {f"{k}_ms": 1000 * statistics.median(v) for k, v in parts.items()}


def eviction(blocks: int = 16384, per_prompt: int = 72) -> dict[str, float]:
    from metrale.cache.block_pool import BlockPool
    from metrale.cache.radix import RadixPrefixCache

    pool = BlockPool(blocks + 1)
    cache = RadixPrefixCache(pool, 16)
    rng = random.Random(0)
    for _ in range(blocks // per_prompt):
        tokens = [rng.randint(0, 150_000) for _ in range(per_prompt * 16)]
        got = pool.allocate(per_prompt)
        cache.insert(tokens, got, 0)
        pool.decref(got)
    cached = cache.stats.cached_blocks
    return {"cached_blocks": cached, "evict8_ms": _median_ms(lambda: cache.evict(8), 50)}


def projections() -> dict[str, float]:
    from metrale.kernels import cpu_gemv

    path = cpu_gemv.build()
    p, n = ctypes.c_void_p, ctypes.c_long
    shapes = [(1024, 512), (512, 512), (3072, 512), (512, 1536)] * 8  # small: 8 layers
    weights = {"f32": [torch.randn(o, i) for o, i in shapes]}
    weights["bf16"] = [w.to(torch.bfloat16) for w in weights["f32"]]
    xs = {i: torch.randn(1, i) for i in (512, 1536)}
    ys = {o: torch.empty(1, o) for o in (512, 1024, 3072)}
    out: dict[str, float] = {}
    for kind, ws in weights.items():
        fn = cpu_gemv.kernel_function(
            path, f"metrale_gemv_{kind}", [p, n, p, p, p, n, n, n, ctypes.c_int]
        )

        def run(fn: Any = fn, ws: list[torch.Tensor] = ws) -> None:
            for (o, i), w in zip(shapes, ws, strict=True):
                fn(xs[i].data_ptr(), i, w.data_ptr(), None, ys[o].data_ptr(), 1, i, o, 1)

        run()
        ms = _median_ms(run, 30)
        mb = sum(w.numel() * w.element_size() for w in ws) / 1e6
        out[f"{kind}_ms"], out[f"{kind}_gb_s"] = ms, mb / ms
    return out


def collector(tiny_model: str) -> dict[str, float]:
    from metrale.config import EngineConfig
    from metrale.engine.engine_process import EngineProcess
    from metrale.server.app import create_app

    engine = EngineProcess(EngineConfig(model=tiny_model, device="cpu"))
    try:
        create_app(engine)
        tracked = len(gc.get_objects())
        full = _median_ms(gc.collect, 3)
        gc.freeze()
        frozen = _median_ms(gc.collect, 3)
        gc.unfreeze()
    finally:
        engine.shutdown()
    return {"tracked_objects": tracked, "full_collect_ms": full, "after_freeze_ms": frozen}


def bf16_agreement() -> dict[str, float]:
    from tests.helpers.checkpoints import DENSE_VARIANTS
    from tests.helpers.fused_decode import agreement, greedy_run

    variant = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
    rows = agreement(greedy_run(variant, "float32")[1], greedy_run(variant, "bf16")[1])
    return {
        "tokens_before_divergence": sum(same for _, same, _, _ in rows),
        "tokens": sum(tokens for _, _, tokens, _ in rows),
        "max_logprob_diff": max((d for *_, diffs in rows for d in diffs), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny-model", default="/tmp/peersm/tiny")
    parser.add_argument("--out-dir", default="bench/records")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures: dict[str, Any] = {}
    if os.path.isdir(args.tiny_model):  # first: the process holds only what a server holds
        figures["server_collector"] = collector(args.tiny_model)
    figures |= {
        "output_path_128_streams": output_path(),
        "radix_eviction": eviction(),
        "small_projections": projections(),
        "bf16_agreement_qwen3_qknorm": bf16_agreement(),
    }
    for key, value in figures.items():
        print(key, {k: round(v, 4) if isinstance(v, float) else v for k, v in value.items()})
    path = write_record(
        "host-costs-cpu", model_shape="various", figures=figures, device="cpu",
        config={"threads": 1, "tiny_model": args.tiny_model}, out_dir=args.out_dir,
    )  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
