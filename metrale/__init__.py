"""metrale: an LLM inference engine and OpenAI/Anthropic-compatible server in Python.

Owner: the package's public surface: `LLM`, `SamplingParams`, `EngineConfig`, `Engine` and the
output types.

Invariants:
- Importing the package imports nothing heavy: the names resolve on first use, so the
  pure-Python parts (scheduler core, sampling parameters) never pull in torch through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from metrale.config import EngineConfig
    from metrale.engine.engine import Engine
    from metrale.engine.llm import LLM
    from metrale.engine.request import CompletionOutput, Logprob, RequestOutput
    from metrale.engine.translate import BeamSearchParams
    from metrale.sampling.params import SamplingParams

_EXPORTS = {
    "LLM": "metrale.engine.llm",
    "BeamSearchParams": "metrale.engine.translate",
    "CompletionOutput": "metrale.engine.request",
    "Engine": "metrale.engine.engine",
    "EngineConfig": "metrale.config",
    "Logprob": "metrale.engine.request",
    "RequestOutput": "metrale.engine.request",
    "SamplingParams": "metrale.sampling.params",
}

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
from metrale.version import __version__ as __version__  # noqa: E402


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metrale' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
