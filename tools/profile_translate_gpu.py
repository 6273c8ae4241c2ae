"""Where an NLLB beam step goes on the GPU (issue 18): the NLLB-200-distilled-600M shape (random
weights, bf16), `--batch` sentences x `--beams` beams, the decoder step graphed over the batch
ladder (the H200 path of `metrale bench translate --step-graphs`).

    python3 tools/profile_translate_gpu.py [--batch 32] [--beams 4] [--max-tokens 64]
        [--shape nllb-600m] [--out DIR]

Prints and writes (`DIR/profile_translate.json` and `.txt`): the wall time of one batch and
its decoder steps; the CUDA kernel time inside it (torch.profiler, kernels of graph replays
included) by kernel name; the host time by torch op and by Python function (cProfile of
the same batch), so the step's wall time splits into device work and host work.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="nllb-600m")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this tool")
    p.add_argument("--torch-ops", action="store_true", help="the torch reference ops on CUDA")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from metrale.bench.translate import LANGS, build_random_nllb, shape_config
    from metrale.engine.translate import Translator
    from metrale.model_engine.beam import BeamParams

    tmp = Path(tempfile.mkdtemp(prefix="metrale-profile-translate-"))
    try:
        shape, raw = shape_config(args.shape, None)
        model_dir, _ = build_random_nllb(tmp / "model", raw, init_std=0.05, device=args.device)
        blocks = -(-(args.max_tokens + 2) // 16)
        t = Translator(
            model_dir, device=args.device, dtype=args.dtype, block_size=16,
            num_kv_blocks=2 * args.batch * args.beams * blocks + 64,
            max_model_len=args.max_tokens + 2, torch_ops=args.torch_ops,
        )  # fmt: skip
        cuda = args.device == "cuda"

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        if cuda and not args.no_graphs:
            t.model.enable_step_graphs(
                max_rows=args.batch * args.beams, max_sources=args.batch, source_cap=32
            )
        cfg = t.model.config
        rng = random.Random(0)
        pool = list(range(4, cfg.vocab_size - len(LANGS)))
        sources = [
            [rng.choice(pool) for _ in range(rng.randrange(8, 25))] for _ in range(args.batch)
        ]
        params = BeamParams(num_beams=args.beams, early_stopping=True, max_tokens=args.max_tokens)

        def batch() -> None:
            reqs = [t.request(s, *LANGS, params) for s in sources]
            t.run(reqs)

        batch()
        sync()
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            batch()
            sync()
            walls.append(time.perf_counter() - start)
        steps = int(t.last_stats.get("forwards", 0))
        wall = min(walls)

        from torch.profiler import ProfilerActivity, profile

        with profile(
            activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        ) as prof:
            batch()
            sync()
        events = prof.key_averages()
        kernels = sorted(
            (
                (e.key, e.device_time_total / 1e3, e.count)
                for e in events
                if e.device_time_total > 0
            ),
            key=lambda x: -x[1],
        )
        cuda_ms = (
            sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3
        )
        cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=30)
        prof_cp = cProfile.Profile()
        prof_cp.enable()
        batch()
        sync()
        prof_cp.disable()
        s = io.StringIO()
        pstats.Stats(prof_cp, stream=s).sort_stats("tottime").print_stats(30)
        host = s.getvalue()
        report = {
            "shape": shape, "batch": args.batch, "beams": args.beams,
            "max_tokens": args.max_tokens, "dtype": args.dtype, "graphs": cuda and not args.no_graphs,
            "kernels": {k: t.model.module.ops.implementations.get(k, "torch")
                        for k in ("linear", "write_kv", "paged_attention")},
            "batch_wall_ms": [round(w * 1e3, 2) for w in walls], "decoder_steps": steps,
            "ms_per_step": round(wall * 1e3 / max(1, steps), 3),
            "cuda_self_ms_profiled_batch": round(cuda_ms, 2),
            "top_device_ops": [(k, round(ms, 3), n) for k, ms, n in kernels[:40]],
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        }  # fmt: skip
        text = json.dumps(report, indent=1) + "\n\n" + cpu_table + "\n\n" + host
        print(text)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            tag = "_torch_ops" if args.torch_ops else ""
            (out / f"profile_translate{tag}.json").write_text(json.dumps(report, indent=1))
            (out / f"profile_translate{tag}.txt").write_text(text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
