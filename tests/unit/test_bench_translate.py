"""`metrale bench translate` runs end to end on the CPU against the transformers peer (the
path the H200 session runs with the NLLB-600M shape, here on the tiny shape): float32 top
hypotheses agree with `generate` at every batch size, eager and with the static decoder step
(`--step-graphs`), and the record names the device, dtype and peer; asking for CUDA where
there is none is an error, never a CPU run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from metrale.bench import translate
from metrale.errors import InvalidRequestError


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    translate.add_arguments(parser)
    return parser.parse_args(list(extra))


def test_bench_translate_against_transformers_on_cpu(tmp_path: Path) -> None:
    args = _args(
        "--device", "cpu", "--dtype", "float32", "--peer", "transformers", "--batch-sizes", "1,3",
        "--sentences", "6", "--batch1-sentences", "2", "--max-tokens", "6",
        "--step-graphs", "--out-dir", str(tmp_path),
    )  # fmt: skip
    figures = translate.run(args)
    (record,) = tmp_path.glob("*-translate-tiny-nllb.json")
    saved = json.loads(record.read_text())
    assert saved["config"]["device"] == "cpu" and saved["config"]["dtype"] == "float32"
    assert saved["config"]["peer"] == "transformers"
    assert saved["device"].startswith("cpu")
    assert saved["figures"].keys() == saved["peer_figures"].keys() == {"batch1", "batch3"}
    for key, n in (("batch1", 2), ("batch3", 6)):
        fig = figures[key]
        assert fig["sentences"] == saved["peer_figures"][key]["sentences"] == n
        # float32 on the same weights: the same search, token for token.
        assert fig["top_hypothesis_agrees_with_transformers"] == f"{n}/{n}"
        assert fig["sentences_per_s"] > 0 and fig["ratio_vs_transformers"] > 0
        assert 0 < fig["mean_output_tokens"] <= 7  # 6 tokens, plus the EOS when one ended it
        graphed = fig["step_graphs"]  # the static step body (eager on the CPU), same search
        assert graphed["top_hypothesis_agrees_with_transformers"] == f"{n}/{n}"
        assert graphed["graph_replays"] > 0 and graphed["eager_forwards"] == 0
    assert saved["config"]["step_graphs"]["captured"] == []  # nothing to capture on a CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_bench_translate_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="cuda"):
        translate.run(_args("--device", "cuda", "--out-dir", str(tmp_path)))
    assert not list(tmp_path.iterdir())
