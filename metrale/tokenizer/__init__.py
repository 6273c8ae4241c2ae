"""Tokenizer package: checkpoint tokenizers, chat templates, incremental detokenization, stops.

Owner: tokenizer package. Layers above (engine, server) import from here, never from the
submodules' private names.

Invariants:
- Nothing here imports torch or transformers; `tokenizers` and `jinja2` are the only
  third-party dependencies.
- Every error a user or checkpoint can cause is a `metrale.errors` exception.
"""

from metrale.tokenizer.chat_template import ChatTemplateRenderer
from metrale.tokenizer.detokenizer import IncrementalDetokenizer
from metrale.tokenizer.stop import StopStringMatcher
from metrale.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateRenderer", "IncrementalDetokenizer", "StopStringMatcher", "Tokenizer"]
