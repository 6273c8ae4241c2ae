"""The engine flags: every `EngineConfig` field as a command-line flag, derived in one place.

Owner: cli. `add_engine_arguments` adds the flags to a parser and `engine_config_from_args`
reads them back, so every subcommand (`generate`, `serve`, `bench`) spells them alike
(`--max-model-len`, `--num-kv-blocks`, `--enable-prefix-caching/--no-enable-prefix-caching`).
Both `metrale.cli` and `metrale.server.launch` import this module; neither imports the other.

Invariants:
- One flag per `EngineConfig` field, named after it (`_` -> `-`), typed by its annotation,
  defaulting to its default; booleans take `--x/--no-x`, lists one or more values.
- `FLAG_HELP` holds the help text of the flags that need more than their name.
- `--help` groups the flags by topic (`FLAG_TOPICS`, in `TOPICS` order); a field not listed
  there lands in `DEFAULT_TOPIC`, so a new `EngineConfig` field needs no entry to appear.
  Every flag's help ends with its default unless the help text already says it.
- `--served-model-name` takes several names (vLLM's shape): `EngineConfig` gets the first,
  `served_model_names` returns them all for the server.
- Importing this module is cheap (argparse and the config dataclass only).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any

from metrale.config import EngineConfig

FLAG_HELP = {
    "model": "checkpoint directory (default: the bundled metrale-tiny-code)",
    "tokenizer": "tokenizer directory (default: the checkpoint's)",
    "device": "auto | cpu | cuda",
    "dtype": "auto | float32 | bfloat16 | float16",
    "max_model_len": "longest prompt + output in tokens (default: the checkpoint's)",
    "max_num_batched_tokens": "most tokens in one forward (default: 2048 on the CPU, 8192 on "
    "CUDA, at least --max-num-seqs)",
    "max_num_seqs": "most sequences running at once",
    "block_size": "tokens per KV block (a power of two)",
    "num_kv_blocks": "exact KV pool size in blocks, the null block included (default: sized "
    "from memory)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (weights, "
    "activations, KV, graphs)",
    "cpu_kv_cache_gb": "KV memory budget on the CPU in GiB, when --num-kv-blocks is not given",
    "cpu_threads": "torch threads of the engine on the CPU (default: the cores this process may "
    "use, less one for the HTTP process when serving; else OMP_NUM_THREADS when set)",
    "kv_cache_dtype": "auto (the model dtype) | fp8 (alias fp8_e4m3): float8 E4M3 K/V with a "
    "K and a V scale per layer (the checkpoint's k_scale/v_scale, else calibrated on the first "
    "prefill); twice the blocks per GiB of bfloat16",
    "swap_space_gb": "host memory for swapped-out KV (preemption mode swap), GiB",
    "high_speed_swap": "CPU: each sequence keeps only its first and newest blocks in the KV "
    "pool, older ones in host memory where attention reads them (needs "
    "--no-enable-prefix-caching and recompute preemption)",
    "high_speed_swap_blocks_per_seq": "blocks a sequence keeps resident besides its first, "
    "with --high-speed-swap",
    "swap_spill_dir": "directory where preemption swap goes past --swap-space-gb, instead of "
    "falling back to recompute (default: none)",
    "swap_spill_gb": "size of the swap spill directory in GiB",
    "kv_offload_host_gb": "host memory (GiB) that keeps KV blocks the prefix cache evicts, "
    "found again by later prompts (0: off)",
    "kv_offload_disk": "directory keeping blocks the host tier evicts, valid across restarts "
    "(default: none)",
    "kv_offload_disk_gb": "size of the disk tier in GiB",
    "seed": "seed of the sampler for unseeded requests",
    "served_model_name": "model name(s) in the API; requests may name any of them, answers "
    "carry the first (default: the checkpoint directory's name)",
    "chat_template": "a Jinja chat template file or string (default: the tokenizer's)",
    "enforce_eager": "no CUDA graphs: every forward runs eagerly",
    "max_images_per_request": "vision models: most images in one request",
    "max_image_bytes": "vision models: most encoded bytes of one image",
    "max_image_pixels": "vision models: most decoded pixels (width x height) of one image",
    "allowed_media_domains": "vision models: comma-separated hosts the server may fetch "
    "http(s) image URLs from (and their subdomains); without it only data: URLs are read "
    "(default: none)",
    "video_fps": "vision models: frames per second a video (GIF) is sampled at, and a list of "
    "frames is taken to be at",
    "max_video_frames": "vision models: most frames of one video after sampling",
    "max_queue": "most requests waiting for admission; more get 503",
    "enable_prefix_caching": "reuse KV of shared prompt prefixes",
    "ssm_snapshot_slots": "hybrid models: recurrent-state snapshots kept for prefix-cache hits "
    "(each one full SSM state of a sequence; 0 bypasses the prefix cache on them)",
    "ssm_snapshot_min_gap_tokens": "hybrid models: skip a prefill snapshot this close to the "
    "one the prompt restores (each costs a forward; default: 2 blocks on CPU, 512 on CUDA)",
    "preemption_mode": "recompute | swap",
    "batch_invariant": "CPU: kernels whose results for a request never depend on what shares "
    "its batch or how its prompt was chunked (byte-identical outputs; slower)",
    "scheduling_policy": "fcfs: requests in arrival order | priority: by the request's "
    "`priority` (lower first), then arrival; preemption takes the lowest priority first",
    "request_timeout": "per-request deadline in seconds (default: none; 0: none)",
    "load_format": "auto | dummy (random weights of the config's shapes)",
    "quantization": "fp8: quantize a float checkpoint's attention/MLP projections to FP8 E4M3 "
    "(per-channel scales) at load and run FP8 kernels (CUDA only; FP8 checkpoints need no "
    "flag) | fp8-block: the same with one scale per 128x128 block, the layout of FP8 "
    "checkpoints such as Qwen3-*-FP8 (default: none)",
    "generation_config": "auto: unset temperature / top_p / top_k / min_p / repetition_penalty "
    "take the model's generation_config.json values (as vLLM) | none: the engine's defaults",
    "async_scheduling": "launch each plain decode step before the previous one is read back "
    "(input tokens fed on the device); --no-async-scheduling plans every step after the last",
    "speculative_config": "speculative decoding as JSON, in vLLM's shape, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4}\' (methods: ngram, suffix, mtp, draft_model; default: off)',
    "enable_lora": "allocate LoRA adapter slots even with no --lora-modules (adapters loaded "
    "later: offline lora_request, or the runtime endpoints)",
    "lora_modules": "PEFT adapters served from start-up, name=DIR [name=DIR ...]; a request "
    "names one as its model",
    "max_loras": "device slots: adapters that can run in one batch",
    "max_lora_rank": "highest adapter rank a slot holds",
    "max_cpu_loras": "adapters kept in host memory between promotions (default: 2 x --max-loras)",
    "tensor_parallel_size": "ranks (GPUs) the model is sharded over: N - 1 worker processes on "
    "this host, or the ranks of a torchrun world",
    "enable_expert_parallel": "MoE models with --tensor-parallel-size: whole experts per rank "
    "instead of slices of every expert",
}


#: `--help` sections, in order: (title, description). A topic without flags shows nothing.
TOPICS: dict[str, str] = {
    "model": "what is served and how it is read",
    "memory": "KV cache, prefix cache and swap",
    "scheduling": "batching, admission, preemption, deadlines and step execution",
    "speculation": "speculative decoding",
    "lora": "LoRA adapters",
    "vision": "image input (vision-language models)",
    "parallel": "several GPUs: tensor and expert parallelism",
    "engine": "other engine settings",
}
DEFAULT_TOPIC = "engine"
#: The topic of each `EngineConfig` field (others: `DEFAULT_TOPIC`).
FLAG_TOPICS: dict[str, str] = {
    **dict.fromkeys(
        ("model", "tokenizer", "device", "dtype", "max_model_len", "served_model_name",
         "chat_template", "load_format", "quantization", "generation_config", "seed"),
        "model",
    ),
    **dict.fromkeys(
        ("block_size", "num_kv_blocks", "gpu_memory_utilization", "cpu_kv_cache_gb", "kv_cache_dtype",
         "enable_prefix_caching", "ssm_snapshot_slots", "ssm_snapshot_min_gap_tokens", "swap_space_gb", "swap_spill_dir",
         "swap_spill_gb", "high_speed_swap", "high_speed_swap_blocks_per_seq", "kv_offload_host_gb",
         "kv_offload_disk", "kv_offload_disk_gb"),
        "memory",
    ),
    **dict.fromkeys(
        ("max_num_seqs", "max_num_batched_tokens", "preemption_mode", "scheduling_policy", "batch_invariant", "request_timeout",
         "max_queue", "async_scheduling", "enforce_eager", "cpu_threads"),
        "scheduling",
    ),
    "speculative_config": "speculation",
    **dict.fromkeys(
        ("enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras"), "lora"
    ),
    **dict.fromkeys(
        ("max_images_per_request", "max_image_bytes", "max_image_pixels", "allowed_media_domains",
         "video_fps", "max_video_frames"),
        "vision",
    ),
    **dict.fromkeys(("tensor_parallel_size", "enable_expert_parallel"), "parallel"),
}  # fmt: skip


def with_default(help_text: str, default: Any) -> str:
    """`help_text` ending with its default, unless it already names one."""
    if re.search(r"\bdefault:? ", help_text):
        return help_text
    shown = "none" if default is None else default
    if isinstance(default, bool):
        shown = "on" if default else "off"
    return f"{help_text} (default: {shown})"


def topic_groups(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One argument group per topic of `TOPICS`, in that order."""
    return {name: parser.add_argument_group(name, text) for name, text in TOPICS.items()}


def drop_empty_groups(parser: argparse.ArgumentParser) -> None:
    """Take the groups that got no flag out of `--help`."""
    for group in list(parser._action_groups):
        if group.title in TOPICS and not group._group_actions:
            parser._action_groups.remove(group)


def _base_type(annotation: Any) -> type:
    hints = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or hints:
        return next(t for t in hints if t is not type(None))
    return annotation


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, positional_model: bool = False
) -> None:
    hints = typing.get_type_hints(EngineConfig)
    groups = topic_groups(parser)
    for f in dataclasses.fields(EngineConfig):
        group = groups[FLAG_TOPICS.get(f.name, DEFAULT_TOPIC)]
        if f.name == "model" and positional_model:
            group.add_argument("model", nargs="?", default=None, help=FLAG_HELP["model"])
            group.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _base_type(hints[f.name])
        help_text = with_default(FLAG_HELP.get(f.name, f.name.replace("_", " ")), f.default)
        if f.name == "served_model_name":
            # vLLM's shape: several names; the first is the one answers carry.
            group.add_argument(flag, nargs="+", default=f.default, help=help_text)
        elif typ is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        elif typing.get_origin(typ) is list:
            (item,) = typing.get_args(typ)
            group.add_argument(flag, nargs="+", type=item, default=f.default, help=help_text)
        else:
            group.add_argument(flag, type=typ, default=f.default, help=help_text)
    drop_empty_groups(parser)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    names = served_model_names(args)
    values["served_model_name"] = names[0] if names else None
    if getattr(args, "model_flag", None):
        values["model"] = args.model_flag
    values.update(overrides)
    return EngineConfig(**values)


def served_model_names(args: argparse.Namespace) -> list[str]:
    """Every `--served-model-name` given (empty: the checkpoint's name is served)."""
    names = getattr(args, "served_model_name", None)
    if names is None:
        return []
    return [names] if isinstance(names, str) else list(names)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
