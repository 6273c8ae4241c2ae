"""`metrale bench lora`: multi-LoRA overhead against the base model, offline.

Owner: bench. On a model of a committed config (`--config-dir`, random weights), `--adapters`
random PEFT adapters of rank `--rank` on every projection (q/k/v/o, gate/up/down) are written
to a temporary directory. Two figures, each against the same engine settings without LoRA:

- throughput: `--requests` requests (`--prompt-len` random tokens, `--output-len` tokens,
  ignore_eos, greedy) at `--concurrency` running sequences, spread round-robin over the
  adapters; output tok/s, and `throughput_ratio` = LoRA / base (the issue's bar: >= 0.8 at 64
  requests over 8 adapters of rank 16 on the Qwen3-8B shape);
- batch-1 decode: tok/s of one request decoding `--latency-tokens` tokens with an adapter,
  and `decode_ratio` = with / without (bar: >= 0.85).

The record lands under `bench/records/` (instrument "lora").
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from metrale.bench.flags import COMMITTED_CONFIG_HELP, add_engine_flags, add_flags, add_model_flags
from metrale.bench.offline import (
    _engine,
    _engine_info,
    _print_table,
    _sync,
    decode_latency,
    drain,
    vars_of,
)
from metrale.bench.record import write_record
from metrale.engine.engine import Engine
from metrale.layers.lora import LORA_TARGETS
from metrale.model_engine.lora_peft import adaptable_shapes
from metrale.sampling.params import SamplingParams


def write_random_adapters(engine: Engine, count: int, rank: int, out: Path) -> list[Path]:
    """`count` random PEFT adapters of `rank` on every adaptable projection of `engine`'s
    model, written as adapter_config.json + adapter_model.safetensors under `out`."""
    import json

    from safetensors.torch import save_file

    shapes = adaptable_shapes(engine.model.module)  # type: ignore[attr-defined]
    module_of = {t: "self_attn" if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                 for t in LORA_TARGETS}  # fmt: skip
    dirs = []
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for (layer, target), (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module_of[target]}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
        d = out / f"adapter-{i}"
        d.mkdir(parents=True)
        save_file(
            {k: v.to(torch.bfloat16) for k, v in tensors.items()},
            str(d / "adapter_model.safetensors"),
        )
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(LORA_TARGETS), "bias": "none",
        }))  # fmt: skip
        dirs.append(d)
    return dirs


def _throughput(engine: Engine, args: argparse.Namespace, adapter_ids: list[int]) -> float:
    gen = torch.Generator().manual_seed(7)
    top = engine.vocab_size - 10
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    _sync(engine)
    start = time.perf_counter()
    for i in range(args.requests):
        prompt = torch.randint(10, top, (args.prompt_len,), generator=gen).tolist()
        adapter = adapter_ids[i % len(adapter_ids)] if adapter_ids else 0
        engine.add_request(f"lora-tp-{i}", prompt, params, adapter_id=adapter, final_only=True)
    produced = drain(engine)
    return produced / (time.perf_counter() - start)


def _decode_tok_s(engine: Engine, tokens: int, adapter_id: int, seed: int) -> float:
    return decode_latency(engine, 64, tokens, seed, adapter_id)["tok_s"]


def _free(engine: Engine) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = {"max_num_seqs": args.concurrency}
    base = _engine(args, **settings)
    _decode_tok_s(base, 8, 0, seed=1)  # warm-up
    figures: dict[str, Any] = {"base_output_tok_s": _throughput(base, args, [])}
    figures["base_decode_tok_s"] = _decode_tok_s(base, args.latency_tokens, 0, seed=2)
    tmp = Path(tempfile.mkdtemp(prefix="metrale-bench-lora-"))
    try:
        dirs = write_random_adapters(base, args.adapters, args.rank, tmp)
        _free(base)
        modules = [f"a{i}={d}" for i, d in enumerate(dirs)]
        lora = _engine(args, **settings, lora_modules=modules, max_loras=args.adapters,
                       max_lora_rank=max(args.rank, 16))  # fmt: skip
        ids = [e.adapter_id for e in lora.model.lora_adapters()]
        _decode_tok_s(lora, 8, ids[0], seed=1)  # warm-up
        figures["lora_output_tok_s"] = _throughput(lora, args, ids)
        figures["lora_decode_tok_s"] = _decode_tok_s(lora, args.latency_tokens, ids[0], seed=2)
        figures["throughput_ratio"] = figures["lora_output_tok_s"] / figures["base_output_tok_s"]
        figures["decode_ratio"] = figures["lora_decode_tok_s"] / figures["base_decode_tok_s"]
        figures["lora_stats"] = lora.lora_stats()
        figures["lora_eager_forwards"] = lora.model.forward_counters().get("lora_eager_forwards", 0)
        info = _engine_info(lora)
        _free(lora)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shape = args.shape or Path(args.config_dir).name
    path = write_record(
        "lora", model_shape=shape, figures=figures, device=args.device,
        config={**vars_of(args), **info}, out_dir=args.out_dir,
    )  # fmt: skip
    _print_table("lora", shape, figures, None, path)
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, config_required=True, config_help=COMMITTED_CONFIG_HELP)
    add_engine_flags(parser, max_model_len=2048)
    add_flags(parser, {
        "--adapters": 8, "--rank": 16, "--concurrency": 64, "--requests": 128,
        "--prompt-len": 256, "--output-len": 256, "--latency-tokens": 128,
        "--out-dir": "bench/records",
    })  # fmt: skip
