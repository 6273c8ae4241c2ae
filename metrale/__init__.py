"""metrale: an LLM inference engine and OpenAI/Anthropic-compatible server in Python.

Owner: the package's public surface: `LLM`, `SamplingParams`, `EngineConfig`, `Engine` and the
output types. Everything else is imported from its own module.
"""

from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.engine.llm import LLM
from metrale.engine.request import CompletionOutput, Logprob, RequestOutput
from metrale.sampling.params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
