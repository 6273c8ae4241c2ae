"""Sampling: request parameters, logits processors and the batched sampler.

Owner: sampling. `SamplingParams` (pure Python) is what the server, scheduler and engine
share; `Sampler` turns a batch of logits into tokens and logprobs on the model's device.

Invariants:
- Importing this package, or `metrale.sampling.params`, never imports torch: the torch-based
  names (`Sampler`, `SamplingRow`, `SamplerOutput`, ...) load on first attribute access, so
  the scheduler core can depend on `SamplingParams` alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from metrale.sampling.params import (
    GREEDY_TEMPERATURE,
    MAX_LOGPROBS,
    SamplingParams,
    derive_choice_seed,
)

if TYPE_CHECKING:
    from metrale.sampling.sampler import (
        SampledBatch,
        Sampler,
        SamplerOutput,
        SamplingRow,
        gather_logprobs,
    )

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_LOGPROBS",
    "SampledBatch",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingRow",
    "derive_choice_seed",
    "gather_logprobs",
]

_LAZY = {
    "SampledBatch": "metrale.sampling.sampler",
    "Sampler": "metrale.sampling.sampler",
    "SamplerOutput": "metrale.sampling.sampler",
    "SamplingRow": "metrale.sampling.sampler",
    "gather_logprobs": "metrale.sampling.sampler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
