"""Fixtures of the server tests: the tiny checkpoint and an in-process reference `LLM`.

Owner: tests (server). Each test module starts its own `metrale serve` subprocess (module
scope) with the flags it needs; the reference `LLM` is shared by the whole session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale import LLM
from tests.server.helpers import tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return tiny_checkpoint()


@pytest.fixture(scope="session")
def reference(checkpoint: Path) -> LLM:
    """What the server must reproduce token for token (same checkpoint, CPU, float32)."""
    return LLM(str(checkpoint), device="cpu", num_kv_blocks=256, enable_prefix_caching=False)
