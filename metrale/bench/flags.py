"""The command-line flags several bench instruments share.

Owner: bench. Each instrument's `add_arguments` builds its parser from these and its own
flags; a helper only adds flags, with the defaults and help its caller gives.

Invariants:
- `add_flags` types a flag by its default (int, float, else a string), as the instruments'
  own `add_argument(..., type=int, default=...)` lines did; a bool default is refused (a
  switch is `store_true`, never typed by its default).
"""

from __future__ import annotations

import argparse

#: Help of `--config-dir` for instruments that need a committed config directory.
COMMITTED_CONFIG_HELP = "committed config dir, e.g. bench/configs/qwen3-8b"


def add_model_flags(
    parser: argparse.ArgumentParser,
    *,
    config_dir: str | None = None,
    config_required: bool = False,
    config_help: str | None = None,
    shape_help: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """`--config-dir`, `--shape`, `--device`, `--dtype`: the model an instrument builds."""
    if config_required:
        parser.add_argument("--config-dir", required=True, help=config_help)
    else:
        parser.add_argument("--config-dir", default=config_dir, help=config_help)
    parser.add_argument("--shape", default=None, help=shape_help)
    parser.add_argument("--device", default=device)
    parser.add_argument("--dtype", default=dtype)


def add_engine_flags(parser: argparse.ArgumentParser, *, max_model_len: int) -> None:
    """`--max-model-len`, `--gpu-memory-utilization` (0.9), `--enforce-eager`."""
    add_flags(parser, {"--max-model-len": max_model_len, "--gpu-memory-utilization": 0.9})
    parser.add_argument("--enforce-eager", action="store_true")


def add_flags(parser: argparse.ArgumentParser, defaults: dict[str, int | float | str]) -> None:
    """One `--flag` per entry, with its default, typed by it (int, float, else a string)."""
    for flag, default in defaults.items():
        if isinstance(default, bool):
            raise TypeError(f"{flag}: a bool default is a switch, not a typed flag")
        if isinstance(default, int | float):
            parser.add_argument(flag, type=type(default), default=default)
        else:
            parser.add_argument(flag, default=default)
