"""`metrale bench ttft`: time to first token for a long prompt, cold versus with most of it in
the prefix cache.

Owner: bench.

Method: a warm-up request first (one-time costs), then for each repeat, a fresh random prompt of `--prompt-len` tokens. Cold: the prompt alone
on an engine whose cache holds nothing of it. Warm: a request with the first `--cached-len`
tokens runs to completion first (its KV enters the cache), then the full prompt is timed. TTFT
is wall time from `add_request` to the step that returns the first token. Figures are medians.

On a hybrid model the record also states the SSM snapshot store's cost: bytes per snapshot,
slots, the store's counters after the run, and the time of one snapshot copy (every recurrent
layer's conv and SSM state, live slot to store slot, the copy a capture or a restore does),
timed over repeated copies between two scratch slots so the cache's own snapshots are untouched.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from metrale.bench.flags import add_flags, add_model_flags
from metrale.bench.record import write_record
from metrale.bench.synthetic import prepare_model_dir
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.sampling.params import SamplingParams


def time_to_first_token(engine: Engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.num_cached_tokens


def snapshot_cost(engine: Engine, copies: int = 50) -> dict | None:
    """Bytes and copy time of one SSM snapshot; None on a model without a snapshot store."""
    model = engine.model
    store = getattr(model, "snapshots", None)
    live = getattr(model, "ssm_pool", None)
    if store is None or live is None:
        return None
    device = next(iter(store.pool.layers))[0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # The last slot of each pool as scratch: the run has finished, so no sequence holds the
    # live slot, and the store's slot is rewritten only when its own copy is restored after.
    src, dst = live.layers, store.pool.layers
    ls, ds = len(src[0][0]) - 1, store.num_slots - 1
    saved = [(conv[ds].clone(), ssm[ds].clone()) for conv, ssm in dst]
    times = []
    for _ in range(copies):
        sync()
        start = time.perf_counter()
        for (conv, ssm), (sconv, sssm) in zip(dst, src, strict=True):
            conv[ds].copy_(sconv[ls])
            ssm[ds].copy_(sssm[ls])
        sync()
        times.append(time.perf_counter() - start)
    for (conv, ssm), (c0, s0) in zip(dst, saved, strict=True):
        conv[ds].copy_(c0)
        ssm[ds].copy_(s0)
    ms = 1000 * statistics.median(times)
    return {
        "bytes_per_snapshot": store.bytes_per_snapshot,
        "snapshot_slots": store.num_slots,
        "store_bytes_total": store.bytes_total(),
        "copy_ms_per_snapshot": ms,
        "copy_gb_per_s": store.bytes_per_snapshot / (ms / 1000) / 1e9,
        "store_counters_after_run": model.snapshot_stats(),
    }


def run(args: argparse.Namespace) -> dict:
    model_dir = prepare_model_dir(args.config_dir)
    config = EngineConfig(
        model=str(model_dir), device=args.device, dtype=args.dtype, load_format="dummy",
        max_num_batched_tokens=args.prompt_len, max_model_len=args.prompt_len + 16,
    )  # fmt: skip
    engine = Engine(config)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    cold, warm, cached = [], [], []
    time_to_first_token(engine, "warmup", torch.randint(8, vocab, (64,), generator=gen).tolist())
    for i in range(args.repeats):
        prompt = torch.randint(8, vocab, (args.prompt_len,), generator=gen).tolist()
        t, _ = time_to_first_token(engine, f"cold-{i}", prompt)
        cold.append(t)
        other = torch.randint(8, vocab, (args.prompt_len,), generator=gen).tolist()
        time_to_first_token(engine, f"prime-{i}", other[: args.cached_len])
        t, hit = time_to_first_token(engine, f"warm-{i}", other)
        warm.append(t)
        cached.append(hit)
    figures = {
        "cold_ttft_ms": 1000 * statistics.median(cold),
        "warm_ttft_ms": 1000 * statistics.median(warm),
        "warm_over_cold": statistics.median(warm) / statistics.median(cold),
        # Each warm run follows its cold run: the ratio within a pair cancels slow drifts of a
        # shared machine.
        "warm_over_cold_paired_median": statistics.median(w / c for w, c in zip(warm, cold)),
        "cached_tokens": statistics.median(cached),
        "cold_samples_ms": [1000 * t for t in cold],
        "warm_samples_ms": [1000 * t for t in warm],
    }
    cost = snapshot_cost(engine)
    if cost is not None:
        figures["ssm_snapshots"] = cost
    path = write_record(
        "ttft",
        model_shape=args.shape or Path(args.config_dir).name,
        config={
            "prompt_len": args.prompt_len,
            "cached_len": args.cached_len,
            "repeats": args.repeats,
            "device": str(engine.model.device),
            "dtype": str(engine.model.dtype),
            "config_dir": str(args.config_dir),
            "threads": torch.get_num_threads(),
        },
        figures=figures,
        device=args.device,
        out_dir=args.out_dir,
        notes="peer: the same engine with the prefix cache cold (no cache hit)"
        + (f"; {args.notes}" if args.notes else ""),
    )
    print(
        f"cold TTFT {figures['cold_ttft_ms']:.1f} ms, warm TTFT {figures['warm_ttft_ms']:.1f} ms "
        f"({figures['cached_tokens']:.0f} cached tokens): warm/cold = {figures['warm_over_cold']:.3f}"
    )
    if cost is not None:
        print(
            f"SSM snapshot: {cost['bytes_per_snapshot'] / 2**20:.1f} MiB, "
            f"{cost['copy_ms_per_snapshot']:.3f} ms per copy, {cost['snapshot_slots']} slots"
        )
    print(f"record: {path}")
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(
        parser, config_dir="bench/configs/tiny-2k", shape_help="model shape name for the record",
        device="cpu", dtype="float32",
    )  # fmt: skip
    add_flags(parser, {"--prompt-len": 2000, "--cached-len": 1900, "--repeats": 5,
                       "--out-dir": "bench/records"})  # fmt: skip
    parser.add_argument("--notes", default="", help="appended to the record's notes")
