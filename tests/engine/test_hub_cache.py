"""Issue 17: `metrale serve org/name` looks in the local Hugging Face cache before saying,
clearly, that nothing is downloaded; the model is then served under its repo id."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.engine.intake import resolve_model_dir
from metrale.errors import InvalidRequestError
from tests.server.helpers import tiny_checkpoint


def test_a_repo_id_resolves_to_its_cached_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--tiny-org--tiny-qwen3"
    old, new = repo / "snapshots" / "0000", repo / "snapshots" / "1111"
    shutil.copytree(tiny_checkpoint(), old)
    shutil.copytree(tiny_checkpoint(), new)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0000\n")
    assert resolve_model_dir("tiny-org/tiny-qwen3") == str(old)  # refs/main wins
    engine = Engine(EngineConfig(model="tiny-org/tiny-qwen3", device="cpu", num_kv_blocks=16))
    assert engine.served_model_name == "tiny-org/tiny-qwen3"

    with pytest.raises(InvalidRequestError, match="downloads nothing") as err:
        resolve_model_dir("tiny-org/not-there")
    assert str(tmp_path) in err.value.message
    # A path that exists is never taken for a repo id.
    assert resolve_model_dir(str(new)) == str(new)
