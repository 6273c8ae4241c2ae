"""Issue 17, embeddings: `LLM.embed` and `/v1/embeddings` give the final hidden states of
transformers, pooled (last token or mean) and L2-normalised, float32 CPU; whatever chunking,
prefix cache state or transport (engine thread or engine process) ran them; the official
`openai` SDK's `embeddings.create` (base64 by default) works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from metrale import LLM
from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine
from metrale.engine.engine import Engine
from metrale.engine.engine_process import EngineProcess
from metrale.server.app import create_app
from tests.server.helpers import with_sdk

TEXTS = [
    "def add(a, b):\n    return a + b",
    "hello world",
    "def add(a, b):\n    return a + b  # the same start, then more tokens to pool",
]


def hf_embeddings(checkpoint: Path, ids: list[list[int]], pooling: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for seq in ids:
            hidden = model.model(torch.tensor([seq])).last_hidden_state[0]
            vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
            out.append(torch.nn.functional.normalize(vector, dim=0))
    return out


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_llm_embed_matches_transformers(checkpoint: Path, pooling: str) -> None:
    # Small prefill chunks and a prefix cache warmed with the shared start: neither may
    # change a vector (an embedding computes every prompt position itself).
    llm = LLM(str(checkpoint), device="cpu", num_kv_blocks=64, max_prefill_chunk=5,
              enable_prefix_caching=True)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(t) for t in TEXTS]
    llm.generate(TEXTS[:1])  # caches the first prompt's blocks
    got = llm.embed(TEXTS, pooling=pooling)
    expected = hf_embeddings(checkpoint, ids, pooling)
    for out, want in zip(got, expected):
        assert out.embedding is not None
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=1e-5)
    engine = llm.engine
    model = engine.model
    assert model.num_free_blocks() + model.cache_only_blocks() == model.num_total_blocks()


@pytest.mark.parametrize("transport", ["thread", "process"])
def test_embeddings_route_through_the_sdk(checkpoint: Path, transport: str) -> None:
    config = EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=64)
    handle: Any = AsyncEngine(Engine(config)) if transport == "thread" else EngineProcess(config)
    handle.start()
    try:
        app = create_app(handle, pooling="mean")
        name = handle.info.served_model_name

        async def calls(client: openai.AsyncOpenAI) -> tuple[Any, Any, Any]:
            b64 = await client.embeddings.create(model=name, input=TEXTS)
            floats = await client.embeddings.create(
                model=name, input=TEXTS[1], encoding_format="float"
            )
            with pytest.raises(openai.BadRequestError) as err:
                await client.embeddings.create(model=name, input="x", dimensions=3)
            return b64, floats, err.value

        b64, floats, refused = with_sdk(app, calls)
    finally:
        handle.shutdown()
    tokenizer = handle.tokenizer
    ids = [tokenizer.encode(t) for t in TEXTS]
    expected = hf_embeddings(checkpoint, ids, "mean")
    assert [d.index for d in b64.data] == [0, 1, 2]
    for item, want in zip(b64.data, expected):
        torch.testing.assert_close(torch.tensor(item.embedding), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.tensor(floats.data[0].embedding), expected[1], atol=1e-5, rtol=1e-5
    )
    assert b64.usage.prompt_tokens == sum(map(len, ids))
    assert "dimensions" in str(refused)
