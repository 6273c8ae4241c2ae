"""The model's default sampling parameters, read from its `generation_config.json` (as vLLM's
`--generation-config auto` reads them).

Owner: sampling. `load_sampling_defaults` reads a checkpoint directory once (the engine does it
at start-up); the server's request mapping and `LLM.generate` / `LLM.chat` fill the fields a
request leaves unset from the result. Pure Python, like `metrale.sampling.params`: never
imports torch.

Invariants:
- Only vLLM's keys are read: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`.
  Every other key (`do_sample`, token ids, `max_new_tokens`, ...) is ignored; a key that is
  absent or JSON `null` is "not given" (None).
- Precedence, everywhere: the request's value, else the model's default, else
  `SamplingParams`' own default (`SamplingDefaults.pick`).
- A loaded `SamplingDefaults` is valid: every value passed `SamplingParams`' own checks and is
  normalised as `SamplingParams` would store it (top_k an int, the others floats). A missing
  file gives empty defaults; an unreadable file, a file that is not a JSON object, or a bad
  value raises `CheckpointError` naming the file and the key.
- Instances are frozen: one is shared by every request the engine serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from metrale.errors import CheckpointError, InvalidRequestError
from metrale.sampling.params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"

_HARD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams)}


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults a model's creator recommends; None means "not given" (the engine's applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The given fields only, by name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    def __bool__(self) -> bool:
        return bool(self.as_dict())

    def pick(self, name: str, value: Any) -> Any:
        """`value` if the request set it (not None), else this model's default for `name`, else
        `SamplingParams`' default for it."""
        if value is not None:
            return value
        default = getattr(self, name, None)  # None too for fields it does not hold
        return _HARD_DEFAULTS[name] if default is None else default

    def sampling_params(self, **changes: Any) -> SamplingParams:
        """`SamplingParams` with these defaults, then `changes` (which win), validated."""
        return SamplingParams(**{**self.as_dict(), **changes})


_FIELD_NAMES = tuple(f.name for f in fields(SamplingDefaults))


def sampling_defaults_from_dict(data: Any, source: str) -> SamplingDefaults:
    """The defaults in a parsed `generation_config.json`; errors name `source` and the key."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{source} must hold a JSON object, got {type(data).__name__}")
    given: dict[str, Any] = {}
    for name in _FIELD_NAMES:
        value = data.get(name)
        if value is None:
            continue
        try:
            checked = SamplingParams(**{name: value})
        except InvalidRequestError as exc:
            raise CheckpointError(f"{source}: bad value for '{name}': {exc.message}") from None
        given[name] = getattr(checked, name)
    return SamplingDefaults(**given)


def load_sampling_defaults(model_dir: str | Path) -> SamplingDefaults:
    """The sampling defaults of the checkpoint in `model_dir` (empty without the file)."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingDefaults()
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return sampling_defaults_from_dict(data, str(path))


def describe(defaults: SamplingDefaults) -> str:
    """`name=value, ...` of the given fields, for logs."""
    return ", ".join(f"{k}={v!r}" for k, v in defaults.as_dict().items())


__all__ = [
    "GENERATION_CONFIG_FILE",
    "SamplingDefaults",
    "describe",
    "load_sampling_defaults",
    "sampling_defaults_from_dict",
]
