"""Shared test helpers: fixtures' building blocks that several test packages use.

Owner: the tokenizer package's engineer keeps `tiny_tokenizer`; other helpers name their owner in
their own docstring.

Invariants:
- Helpers write real on-disk artefacts (checkpoint files) that production loaders read unchanged;
  nothing here patches or fakes library code.
- Helpers import neither pytest nor transformers, so benchmarks can use them too.
"""
