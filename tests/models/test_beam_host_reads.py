"""A beam-search step of encoder-decoder translation reads tensors back to the host once
(twice on a step where requests finish: their scores), whatever the number of requests,
eager or through the static step (`EncDecStepGraphs`). On the CPU, the proxy for a device
read is a call of a tensor-to-host method (`tolist`, `item`, `bool`, `int`, ...); on a GPU
`tests/gpu/test_translate_gpu.py` counts real synchronisations. A per-request or per-layer
read would make the GPU path host-bound."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from metrale.model_engine.beam import BeamParams, BeamRequest, BeamSearchDriver
from metrale.model_engine.encdec_model import load_encoder_decoder
from tests.helpers import m2m100 as tiny

EOS = 2
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@contextmanager
def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _f: object = original, **k: object) -> object:
            calls[0] += 1
            return _f(self, *a, **k)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        yield calls
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "static-step"])
def test_one_host_read_per_beam_step(graphed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    variant = tiny.NLLB_STYLE
    model = load_encoder_decoder(tiny.build(variant), num_blocks=400, block_size=4)
    if graphed:
        model.enable_step_graphs(max_sources=16, source_cap=16)
    rng = random.Random(0)
    driver = BeamSearchDriver(model, [EOS])
    for i in range(6):
        body = [rng.randrange(6, 512) for _ in range(rng.randrange(1, 14))]
        params = BeamParams(
            num_beams=4, max_tokens=12, no_repeat_ngram_size=(0, 2)[i % 2],
            min_tokens=(0, 3)[i % 2], n=1 + i % 2,
        )  # fmt: skip
        src = [variant.lang_id("eng_Latn"), *body, EOS]
        driver.add_request(
            BeamRequest(f"r{i}", [EOS], params, source=src, forced=[variant.lang_id("fra_Latn")])
        )
    driver.step()  # admission (the encoder) is not a steady step
    counts = []
    with _counting_reads(monkeypatch) as calls:
        while driver.has_unfinished():
            calls[0] = 0
            finished = driver.step()
            counts.append((calls[0], len(finished)))
    assert len(counts) > 3 and any(f for _, f in counts)
    assert all(reads == 1 + (f > 0) for reads, f in counts), counts
    assert model.block_pool.num_free == model.block_pool.num_usable
