"""`metrale bench latency` and `metrale bench throughput`: offline instruments on the Engine.

Owner: bench.

latency: batch-1 decode after a `--prompt-len` prompt. tok/s = (generated - 1) / time from the
first to the last token (decode only). The roofline measured in the same run is
`copy bandwidth / bytes read per step`, where bytes per step = every weight matrix the step
reads (the embedding table contributes one row unless tied to the LM head; an MoE layer's
experts count only the `top_k` a token is routed to: the active parameters, not the whole
checkpoint) + the KV of the mean context (`bytes_per_step`; the record splits it into dense
weights, routed experts and KV) + on hybrid models the recurrent
state of one slot, read and written. Each weight counts at its stored bytes (`--quantization
fp8`: the projections at 1 byte, their scales at 4 per row).

throughput: the nano-vllm recipe: 256 requests, input and output lengths uniform in
[100, 1024], random token ids, ignore_eos; output tokens / wall time, after a warm-up request.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from metrale.bench.flags import COMMITTED_CONFIG_HELP, add_engine_flags, add_flags, add_model_flags
from metrale.bench.record import write_record
from metrale.bench.synthetic import prepare_model_dir
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


def _engine(args: argparse.Namespace, **overrides: Any) -> Engine:
    model_dir = prepare_model_dir(args.config_dir)
    values = dict(
        model=str(model_dir), device=args.device, dtype=args.dtype, load_format="dummy",
        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
        quantization=getattr(args, "quantization", None),
    )  # fmt: skip
    values.update(overrides)
    return Engine(EngineConfig(**values))


def bytes_per_step(
    module: torch.nn.Module,
    kv_layers: int,
    kv_heads: int,
    head_dim: int,
    context: int,
    kv_element_size: int = 2,
) -> dict[str, int]:
    """The bytes one batch-1 decode step must read, by part: `dense` (every weight the step
    reads whole: attention, norms, dense MLPs, routers, shared experts, the LM head; an
    embedding table contributes one row unless the model is tied (`tied`, logits from it) or
    it is also a projection's weight),
    `experts` (each MoE layer's routed experts only: `top_k / num_experts` of its stacked
    expert weights), `kv` (K and V of `context` tokens of `kv_element_size` bytes) and
    `total`. Works on any module (no `embed_tokens` attribute needed)."""
    from metrale.layers.moe import SparseMoeBlock

    # parameters() is deduplicated: a tied weight counts once
    dense = sum(p.numel() * p.element_size() for p in module.parameters())
    projections = {
        id(m.weight) for m in module.modules() if not isinstance(m, torch.nn.Embedding)
        and isinstance(getattr(m, "weight", None), torch.nn.Parameter)
    }  # fmt: skip
    # Tied models (`tied`) compute logits from the embedding matrix itself: read whole.
    tied = bool(getattr(module, "tied", False))
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding) and not tied and id(m.weight) not in projections:
            dense -= (m.weight.numel() - m.weight.shape[-1]) * m.weight.element_size()
    experts = 0
    for m in module.modules():
        if isinstance(m, SparseMoeBlock):
            stacked = sum(p.numel() * p.element_size() for p in m.experts.parameters())
            dense -= stacked
            experts += stacked * m.gate.spec.top_k // m.gate.spec.num_experts
    kv = context * 2 * kv_layers * kv_heads * head_dim * kv_element_size
    return {"dense": dense, "experts": experts, "kv": kv, "total": dense + experts + kv}


def _bytes_per_step(engine: Engine, context: int) -> dict[str, int]:
    """`bytes_per_step` of the engine's model at its KV dtype, plus on hybrid models (`state`)
    each recurrent layer's slot state read and written once (conv window and float32 SSM
    state)."""
    model = engine.model
    cfg = model.config
    kv_dtype = model.kv_cache.dtype if model.kv_cache.layers else model.dtype
    element = torch.empty((), dtype=kv_dtype).element_size()
    parts = bytes_per_step(
        model.module, model.module.kv_layer_count, cfg.num_key_value_heads, cfg.head_dim,
        context, element,
    )  # fmt: skip
    pool = model.ssm_pool
    parts["state"] = 0 if pool is None else 2 * pool.bytes_total() // pool.num_slots
    parts["total"] += parts["state"]
    return parts


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def drain(engine: Engine) -> int:
    """Step until no request is left; the output tokens of the finished ones (then synced)."""
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
    _sync(engine)
    return produced


def decode_latency(
    engine: Engine, prompt_len: int, tokens: int, seed: int = 0, adapter_id: int = 0
) -> dict[str, float]:
    """Batch-1 greedy decode of `tokens` tokens after a random `prompt_len`-token prompt
    (through LoRA adapter `adapter_id`; 0: the base model): tok/s and step times."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, engine.vocab_size - 10, (prompt_len,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(f"lat-{seed}-{adapter_id}", prompt, params, adapter_id=adapter_id)
    stamps: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.outputs[0].token_ids:
                stamps.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "step_ms_median": 1000 * statistics.median(steps),
        "step_ms_p90": 1000 * sorted(steps)[int(0.9 * (len(steps) - 1))],
        "generated": len(stamps),
    }


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine(args, max_num_seqs=args.max_num_seqs)
    decode_latency(engine, args.prompt_len, 16, seed=99)  # warm-up
    figures: dict[str, Any] = decode_latency(engine, args.prompt_len, args.tokens)
    if engine.model.device.type == "cuda":
        from metrale.bench.hardware import copy_bandwidth

        bandwidth = copy_bandwidth(engine.model.device)
        parts = _bytes_per_step(engine, args.prompt_len + args.tokens // 2)
        per_step = parts["total"]
        figures["copy_bandwidth_gb_s"] = bandwidth / 1e9
        figures["bytes_per_step"] = per_step
        figures["bytes_dense"] = parts["dense"]
        figures["bytes_routed_experts"] = parts["experts"]
        figures["bytes_kv"] = parts["kv"]
        figures["bytes_recurrent_state"] = parts["state"]
        figures["roofline_tok_s"] = bandwidth / per_step
        figures["roofline_ratio"] = figures["tok_s"] / figures["roofline_tok_s"]
    engine_info = _engine_info(engine)
    del engine
    compile_args = {
        "try_compile": args.peer_compile,
        "compile_modes": tuple(args.peer_compile_modes.split(",")),
    }
    peer_shape = (1, args.prompt_len)
    return _compare_and_record("latency", args, engine_info, figures, peer_shape, compile_args)


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine(args, max_num_seqs=args.max_num_seqs)
    rng = random.Random(0)
    n = args.num_requests
    lo, hi = args.min_len, args.max_len
    top = min(10000, engine.vocab_size) - 1  # the recipe draws ids in [0, 10000)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    decode_latency(engine, 64, 8, seed=98)  # warm-up
    _sync(engine)
    start = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, outs)):
        engine.add_request(
            f"tp-{i}",
            p,
            SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True),
            final_only=True,  # as LLM.generate: only finished outputs are read
        )
    produced = drain(engine)
    elapsed = time.perf_counter() - start
    figures: dict[str, Any] = {
        "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + sum(map(len, prompts))) / elapsed,
        "seconds": elapsed,
        "output_tokens": produced,
        "requests": n,
        "steps": engine.num_steps,
        "preemptions": engine.scheduler.stats.preemptions_recompute
        + engine.scheduler.stats.preemptions_swap,
    }
    engine_info = _engine_info(engine)
    del engine
    peer_shape = (args.peer_batch, (lo + hi) // 2)
    return _compare_and_record(
        "throughput", args, engine_info, figures, peer_shape, {"try_compile": False}
    )


def _compare_and_record(
    kind: str,
    args: argparse.Namespace,
    engine_info: dict[str, Any],
    figures: dict[str, Any],
    peer_shape: tuple[int, int],
    compile_args: dict[str, Any],
) -> dict[str, Any]:
    """With `--peer`, time the HF peer (`hf_generate_tok_s` at `peer_shape` = (batch, prompt
    length) with `compile_args`, once the engine's memory is freed) and add `vs_peer`: the
    run's rate (`tok_s` for latency, `output_tok_s` for throughput) over the peer's; then
    write and print the record."""
    shape = args.shape or Path(args.config_dir).name
    peer = None
    if args.peer:
        if torch.cuda.is_available():
            # Reference cycles can keep the engine's weights alive past `del engine`; a
            # Mixtral-8x7B-sized peer (93 GB bf16) needs that memory back.
            gc.collect()
            torch.cuda.empty_cache()
        from metrale.bench.hf_peer import hf_generate_tok_s

        peer = hf_generate_tok_s(
            args.config_dir, *peer_shape, args.peer_tokens, device=args.device,
            dtype=getattr(torch, _dtype_name(args)), **compile_args,
        )  # fmt: skip
        rate = "tok_s" if kind == "latency" else "output_tok_s"
        figures["vs_peer"] = figures[rate] / peer["tok_s"]
    path = write_record(
        kind, model_shape=shape, figures=figures, peer_figures=peer, device=args.device,
        config={**vars_of(args), **engine_info}, out_dir=args.out_dir,
    )  # fmt: skip
    _print_table(kind, shape, figures, peer, path)
    return figures


def _dtype_name(args: argparse.Namespace) -> str:
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if args.device != "cpu" and torch.cuda.is_available() else "float32"


def _engine_info(engine: Engine) -> dict[str, Any]:
    model = engine.model
    info = {
        "kv_blocks": model.num_total_blocks(),
        "kernels": dict(getattr(model, "kernel_implementations", {})),
        "cuda_graphs": getattr(model, "graph_runner", None) is not None,
        "async_scheduling": engine.async_scheduling,
        "fed_steps": engine.fed_steps,
        "drained_steps": engine.drained_steps,
        "weight_dtype": getattr(engine.load_report, "weight_dtype", None),
    }
    breakdown = getattr(engine, "startup_breakdown", None) or getattr(
        engine.load_report, "breakdown", None
    )
    if breakdown is not None:
        info["startup"] = breakdown.summary()
    return info


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "handler" and not callable(v)}


def _print_table(name: str, shape: str, figures: dict[str, Any], peer: Any, path: Path) -> None:
    print(f"{name} {shape}")
    for key, value in figures.items():
        print(f"  {key:24s} {value:.4g}" if isinstance(value, float) else f"  {key:24s} {value}")
    if peer:
        print(f"  peer (transformers)       {peer['tok_s']:.4g} tok/s  {peer}")
    print(f"record: {path}")


def add_common(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, config_required=True, config_help=COMMITTED_CONFIG_HELP)
    add_engine_flags(parser, max_model_len=4096)
    parser.add_argument(
        "--quantization", default=None, choices=["fp8", "fp8-block"],
        help="fp8: the projections quantized to FP8 at load (the roofline counts them at 1 byte)",
    )  # fmt: skip
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out-dir", default="bench/records")
    parser.add_argument("--log-level", default="INFO")


def add_latency(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    add_flags(parser, {"--prompt-len": 128, "--tokens": 256, "--max-num-seqs": 8,
                       "--peer-tokens": 32})  # fmt: skip
    parser.add_argument("--peer-compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument(
        "--peer-compile-modes",
        default="default",
        help="torch.compile modes the peer tries in order, e.g. reduce-overhead,default (the "
        "first that runs is timed; reduce-overhead crashed the process on the H200 image)",
    )


def add_throughput(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    add_flags(parser, {
        "--num-requests": 256, "--min-len": 100, "--max-len": 1024, "--max-num-seqs": 256,
        "--peer-batch": 16, "--peer-tokens": 32,
    })  # fmt: skip
