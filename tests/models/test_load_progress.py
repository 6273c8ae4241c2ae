"""Start-up progress (`metrale.progress`): a load whose stdout is not a terminal logs one line
per weight shard (bytes and rate), one for the weights, and one for KV sizing; a terminal gets
rich's bar instead, which leaves the finished lines behind.

Owner: tests (models).
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest

from metrale import LLM
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.progress import BarProgress, LogProgress, load_progress
from tests.helpers.checkpoints import DENSE_VARIANTS, write_checkpoint

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(VARIANT, tmp_path_factory.mktemp("ckpt") / "s", max_shard_size="100KB")


def test_non_tty_load_logs_each_shard_then_kv_sizing(
    sharded: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) > 1
    assert isinstance(load_progress(), LogProgress)  # pytest captures stdout: no TTY
    with caplog.at_level(logging.INFO, logger="metrale.progress"):
        LLM(str(sharded), device="cpu", num_kv_blocks=64)
    lines = [r.getMessage() for r in caplog.records if r.name == "metrale.progress"]
    shard_lines = [line for line in lines if line.startswith("weights: shard ")]
    assert len(shard_lines) == len(files), lines
    for i, (line, path) in enumerate(zip(shard_lines, files)):
        assert line.startswith(f"weights: shard {i + 1}/{len(files)} {path.name} ("), line
        assert re.search(r" at [\d.]+ (B|KiB|MiB|GiB)/s$", line), line
    # The last shard's running total is the whole checkpoint.
    done, total = shard_lines[-1].split("), ")[1].split(" at ")[0].split(" / ")
    assert done == total, shard_lines[-1]
    assert any(line.startswith(f"weights: {len(files)} file(s), ") for line in lines), lines
    kv = [line for line in lines if line.startswith("KV sizing: ")]
    assert kv and kv[0].startswith("KV sizing: 63 usable blocks x 16 tokens"), lines
    assert lines.index(shard_lines[-1]) < lines.index(kv[0])


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tty_gets_a_bar_and_keeps_the_finished_lines(sharded: Path) -> None:
    stream = _Tty()
    progress = load_progress(stream)
    assert isinstance(progress, BarProgress)
    assert isinstance(load_progress(io.StringIO()), LogProgress)
    Engine(EngineConfig(model=str(sharded), device="cpu", num_kv_blocks=64), progress=progress)
    out = stream.getvalue()
    assert "weights: " in out and "file(s)" in out, out
    assert "KV sizing: 63 usable blocks" in out, out
