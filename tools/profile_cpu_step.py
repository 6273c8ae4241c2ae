"""Where one CPU decode step goes (issue 26): a single stream of the "small" or "tiny"
random-weight Qwen3 of `../shared/peers_cpu/make_model.py`'s sizes (vocab 512, head_dim 64),
in-process (no HTTP, no engine process), split into the model forward, the sampler and the
rest of the engine's host work, plus the top torch ops and Python functions.

    PYTHONPATH=. .venv/bin/python tools/profile_cpu_step.py --size small [--threads 2]

Writes a record under bench/records/ (instrument "profile-cpu-step"). Timings are medians
over the measured decode steps; the op and function tables come from one profiled request.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from metrale import LLM, SamplingParams
from metrale.bench.record import write_record
from tests.helpers.tiny_tokenizer import copy_tokenizer_into

SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4),
}  # fmt: skip


def checkpoint(size: str, out: Path) -> Path:
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
        "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, **SIZES[size],
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    copy_tokenizer_into(out)
    return out


class Timer:
    """Wall time of calls to one method, per call."""

    def __init__(self, obj: Any, name: str) -> None:
        self.samples: list[float] = []
        real = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.samples.append(time.perf_counter() - start)

        setattr(obj, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument(
        "--concurrency", type=int, default=1, help="streams decoded together (the ladder's C)"
    )
    parser.add_argument("--dtype", default="float32", help="float32 (exact) or bfloat16 (opt-in)")
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="the engine's async scheduling (on the CPU a forward is synchronous: compare)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.size, Path(tmp) / args.size)
        llm = LLM(
            str(path), device="cpu", dtype=args.dtype, load_format="dummy",
            num_kv_blocks=64 * args.concurrency,
            async_scheduling=args.async_scheduling,
        )  # fmt: skip
        engine = llm.engine
        prompt = list(range(6, 6 + args.isl))
        prompts = [prompt] * args.concurrency
        # The ladder's requests: greedy, `ignore_eos` (no processing in the sampler).
        params = SamplingParams(temperature=0, max_tokens=args.osl, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        model_fwd = Timer(
            engine.model, "decode_batch_fed" if engine.async_scheduling else "decode_batch"
        )
        mixed = Timer(engine.model, "mixed_forward_batch")
        sampler = Timer(engine.sampler, "sample")
        steps: list[float] = []
        real_step = engine.step

        def step(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return real_step(*a, **k)
            finally:
                steps.append(time.perf_counter() - start)

        engine.step = step  # type: ignore[method-assign]
        for _ in range(args.requests):
            llm.generate(prompts, params)
        engine.step = real_step  # type: ignore[method-assign]
        forwards = sorted(model_fwd.samples + mixed.samples)
        ms = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0  # noqa: E731
        step_ms, fwd_ms, sample_ms = ms(steps), ms(forwards), ms(sampler.samples)
        figures: dict[str, Any] = {
            "step_ms_p50": step_ms,
            "forward_ms_p50": fwd_ms,
            "sampler_ms_p50": sample_ms,
            "other_host_ms_p50": max(step_ms - fwd_ms - sample_ms, 0.0),
            "steps": len(steps),
            "async_scheduling": engine.async_scheduling,
        }
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params)
        ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(prompts, params)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        figures["top_torch_ops"] = ops.splitlines()
        figures["top_python_tottime"] = text.getvalue().splitlines()[-22:]
    record = write_record(
        "profile-cpu-step",
        model_shape=f"qwen3-{args.size}-random",
        config={"isl": args.isl, "osl": args.osl, "threads": args.threads, "dtype": args.dtype,
                "requests": args.requests, "concurrency": args.concurrency, "size": SIZES[args.size],
                "async_scheduling": args.async_scheduling,
                "cpu_ops": os.environ.get("METRALE_CPU_OPS", "lean"),
                "cpu_decode": os.environ.get("METRALE_CPU_DECODE", "fused"),
                "cpu_weights": os.environ.get("METRALE_CPU_WEIGHTS", "float32")},
        figures=figures,
        device="cpu",
    )  # fmt: skip
    print(json.dumps({k: v for k, v in figures.items() if not k.startswith("top_")}, indent=1))
    print("\n".join(figures["top_torch_ops"]))
    print(f"record: {record}")


if __name__ == "__main__":
    main()
