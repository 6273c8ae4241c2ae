"""The CPU projection modes (`METRALE_CPU_LINEAR`, `metrale.kernels.cpu_linear`) against each
other on the issue-26 "small" (or "tiny") random Qwen3, in one process: one `LLM` per mode,
generations alternated between them round by round (the machine is shared: each figure is
the median over rounds, with its range), greedy, ISL 64 / OSL 64, C prompts at once.

    PYTHONPATH=. .venv/bin/python tools/cpu_linear_ab.py --modes onednn,auto,packed \
        --concurrency 1,4,16 [--threads 1]

Reports output tok/s (prefill included: wall time of the whole generate) per mode and C,
and whether every mode gave the same tokens (they differ in float32 summation order only).
Writes a record under bench/records/ (instrument "cpu-linear-ab").
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from metrale import LLM, SamplingParams
from metrale.bench.record import write_record
from tools.profile_cpu_step import SIZES, checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--modes", default="onednn,auto,packed")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    figures: dict[str, dict[str, float]] = {}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.size, Path(tmp) / args.size)
        llms = {}
        before = os.environ.get("METRALE_CPU_LINEAR")
        try:
            for mode in modes:
                os.environ["METRALE_CPU_LINEAR"] = mode
                llms[mode] = LLM(
                    str(path), device="cpu", dtype="float32", load_format="dummy",
                    num_kv_blocks=512, seed=0,
                )  # fmt: skip
        finally:
            if before is None:
                os.environ.pop("METRALE_CPU_LINEAR", None)
            else:
                os.environ["METRALE_CPU_LINEAR"] = before
        params = SamplingParams(temperature=0, max_tokens=args.osl, min_tokens=args.osl)
        for c in (int(v) for v in args.concurrency.split(",")):
            prompts = [list(range(6 + i, 6 + i + args.isl)) for i in range(c)]
            seconds: dict[str, list[float]] = {m: [] for m in modes}
            tokens: dict[str, list[list[int]]] = {}
            for llm in llms.values():
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
            for _ in range(args.rounds):
                for mode, llm in llms.items():
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    seconds[mode].append(time.perf_counter() - start)
                    tokens[mode] = [o.outputs[0].token_ids for o in outs]
            same &= all(tokens[m] == tokens[modes[0]] for m in modes)
            line = []
            for mode, s in seconds.items():
                n = c * args.osl
                figures[f"C={c} {mode}"] = {
                    "tok_s": n / statistics.median(s), "tok_s_min": n / max(s),
                    "tok_s_max": n / min(s),
                }  # fmt: skip
                line.append(
                    f"{mode} {n / statistics.median(s):7.1f} [{n / max(s):.0f}-{n / min(s):.0f}]"
                )
            print(f"C={c:3d} tok/s  " + "  ".join(line), flush=True)
        for mode, llm in llms.items():
            figures[f"counters {mode}"] = {
                k: float(v) for k, v in llm.engine.model.forward_counters().items()
            }
    figures["same_tokens"] = {"all_modes": float(same)}
    print(f"same tokens in every mode: {same}")
    record = write_record(
        "cpu-linear-ab", model_shape=f"qwen3-{args.size}-random", device="cpu",
        config={"modes": modes, "concurrency": args.concurrency, "threads": args.threads,
                "rounds": args.rounds, "isl": args.isl, "osl": args.osl},
        figures=figures,
        notes="in-process LLM per mode, generations alternated; tok/s = C*OSL / wall of the "
        "whole generate (prefill included)",
    )  # fmt: skip
    print(f"record: {record}")


if __name__ == "__main__":
    main()
