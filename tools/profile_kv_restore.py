"""Where a host-tier hit's TTFT goes (issue 19): the Qwen3-8B shape on CUDA, an 8k-token
prefix evicted to the host tier and reused, timed in parts: the restore's host time, the
device time still owed after it, the forward, and the whole TTFT; then a torch profile of
one warm request (top CUDA and CPU ops). Prints the figures and writes a record
(`kv-restore-profile`) under --out-dir.

    PYTHONPATH=. python3 tools/profile_kv_restore.py --config-dir bench/configs/qwen3-8b
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from metrale.bench.kv_tiers import block_payload_bytes, make_room, run_prompt
from metrale.bench.record import write_record
from metrale.bench.synthetic import prepare_model_dir
from metrale.bench.ttft import time_to_first_token
from metrale.config import EngineConfig
from metrale.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config-dir", default="bench/configs/qwen3-8b")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out-dir", default="bench/records")
    args = parser.parse_args()
    model_dir = prepare_model_dir(args.config_dir)
    n, bs = args.prompt_len, 16
    blocks = -(-(n + 1) // bs)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    payload = block_payload_bytes(model_dir, bs, dtype)
    engine = Engine(EngineConfig(
        model=str(model_dir), device=args.device, dtype=dtype, load_format="dummy",
        max_num_batched_tokens=n + 16, max_model_len=n + 16, block_size=bs,
        num_kv_blocks=blocks * 3 // 2 + 2, max_num_seqs=4,
        kv_offload_host_gb=4 * blocks * payload / 2**30,
    ))  # fmt: skip
    model = engine.model
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def fresh() -> list[int]:
        return torch.randint(8, engine.vocab_size, (n,), generator=gen).tolist()

    parts: dict[str, list[float]] = {"restore_host_ms": [], "restore_device_lag_ms": [],
                                     "ttft_ms": [], "cold_ms": []}  # fmt: skip
    real = model._restore_from_tiers

    def timed_restore(*a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = real(*a, **k)
        t1 = time.perf_counter()
        sync()
        parts["restore_host_ms"].append(1000 * (t1 - t0))
        parts["restore_device_lag_ms"].append(1000 * (time.perf_counter() - t1))
        return out

    def evicted_prompt() -> list[int]:
        p = fresh()
        run_prompt(engine, f"p{time.perf_counter()}", p)
        for _ in range(2):
            make_room(engine, n)
            run_prompt(engine, f"f{time.perf_counter()}", fresh())
        make_room(engine, n)
        sync()
        return p

    for i in range(args.repeats + 1):  # the first is a warm-up
        make_room(engine, n)
        sync()
        cold, _ = time_to_first_token(engine, f"cold{i}", fresh())
        p = evicted_prompt()
        model._restore_from_tiers = timed_restore  # type: ignore[method-assign]
        t, hit = time_to_first_token(engine, f"warm{i}", [*p, 7])
        model._restore_from_tiers = real  # type: ignore[method-assign]
        assert hit >= n - bs, hit
        if i:
            parts["ttft_ms"].append(1000 * t)
            parts["cold_ms"].append(1000 * cold)
        else:
            parts["restore_host_ms"].clear()
            parts["restore_device_lag_ms"].clear()
    p = evicted_prompt()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        time_to_first_token(engine, "profiled", [*p, 7])
    p = evicted_prompt()
    python = cProfile.Profile()
    python.enable()
    time_to_first_token(engine, "cprofiled", [*p, 7])
    python.disable()
    stats = pstats.Stats(python)
    rows = [
        (f"{Path(f).name}:{line}:{fn}", calls, round(1000 * tt, 3), round(1000 * ct, 3))
        for (f, line, fn), (_, calls, tt, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
        if "metrale" in f
    ]
    table = prof.key_averages()
    top_cuda = sorted(table, key=lambda e: -e.device_time_total)[:15]
    top_cpu = sorted(table, key=lambda e: -e.self_cpu_time_total)[:20]
    result = {
        "parts_ms": parts,
        # One warm request under cProfile (host time; CUDA work is asynchronous):
        # (function, calls, self ms, cumulative ms), the top by cumulative time.
        "python_cumulative": sorted(rows, key=lambda r: -r[3])[:40],
        "top_cuda_ops": [(e.key, e.count, round(e.device_time_total / 1000, 3)) for e in top_cuda],
        "top_cpu_self_ops": [
            (e.key, e.count, round(e.self_cpu_time_total / 1000, 3)) for e in top_cpu
        ],
    }
    med = statistics.median
    result["summary"] = {
        "cold_ttft_ms": med(parts["cold_ms"]),
        "host_ttft_ms": med(parts["ttft_ms"]),
        "host_over_cold": med(parts["ttft_ms"]) / med(parts["cold_ms"]),
        "restore_host_ms": med(parts["restore_host_ms"]),
        "restore_device_lag_ms": med(parts["restore_device_lag_ms"]),
        "prompt_kv_bytes": (n // bs) * payload,
    }
    print(json.dumps(result, indent=1))
    path = write_record(
        "kv-restore-profile", model_shape=Path(args.config_dir).name,
        config={"prompt_len": n, "repeats": args.repeats, "device": args.device, "dtype": dtype},
        figures=result, device=args.device, out_dir=args.out_dir,
        notes="host-tier hit of an evicted prefix against a cold prompt on the same engine",
    )  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
