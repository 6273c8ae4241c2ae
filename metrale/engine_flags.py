"""The engine flags: every `EngineConfig` field as a command-line flag, derived in one place.

Owner: cli. `add_engine_arguments` adds the flags to a parser and `engine_config_from_args`
reads them back, so every subcommand (`generate`, `serve`, `bench`) spells them alike
(`--max-model-len`, `--num-kv-blocks`, `--enable-prefix-caching/--no-enable-prefix-caching`).
Both `metrale.cli` and `metrale.server.launch` import this module; neither imports the other.

Invariants:
- One flag per `EngineConfig` field, named after it (`_` -> `-`), typed by its annotation,
  defaulting to its default; booleans take `--x/--no-x`.
- `FLAG_HELP` holds the help text of the flags that need more than their name.
- Importing this module is cheap (argparse and the config dataclass only).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from metrale.config import EngineConfig

FLAG_HELP = {
    "model": "checkpoint directory (default: the bundled metrale-tiny-code)",
    "device": "auto | cpu | cuda",
    "dtype": "auto | float32 | bfloat16 | float16",
    "max_model_len": "longest prompt + output in tokens (default: the checkpoint's)",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "most tokens in one forward",
    "num_kv_blocks": "exact KV pool size in blocks (overrides memory sizing)",
    "enable_prefix_caching": "reuse KV of shared prompt prefixes",
    "preemption_mode": "recompute | swap",
    "request_timeout": "per-request deadline in seconds (0: none)",
    "load_format": "auto | dummy (random weights of the config's shapes)",
    "generation_config": "auto: unset temperature / top_p / top_k / min_p / repetition_penalty "
    "take the model's generation_config.json values (as vLLM) | none: the engine's defaults",
    "async_scheduling": "launch each plain decode step before the previous one is read back "
    "(input tokens fed on the device); --no-async-scheduling plans every step after the last",
    "speculative_config": "speculative decoding as JSON, in vLLM's shape, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4}\' (methods: ngram, suffix)',
}


def _base_type(annotation: Any) -> type:
    hints = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or hints:
        return next(t for t in hints if t is not type(None))
    return annotation


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, positional_model: bool = False
) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" and positional_model:
            parser.add_argument("model", nargs="?", default=None, help=FLAG_HELP["model"])
            parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _base_type(hints[f.name])
        help_text = FLAG_HELP.get(f.name, f.name.replace("_", " "))
        if typ is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            parser.add_argument(flag, type=typ, default=f.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if getattr(args, "model_flag", None):
        values["model"] = args.model_flag
    values.update(overrides)
    return EngineConfig(**values)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
