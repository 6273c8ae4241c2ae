"""The batched cross-attention of the M2M100 decoder and sources with padding tokens.

- `CrossBatch` (every request's rows in one masked attention call over their sources gathered
  to the longest) equals each request's rows attending its own source alone, with sources of
  different lengths, padding positions and row counts; its layout check refuses groups that
  do not cover the rows in order.
- Sources holding the pad token: beam search over a batch that mixes them with plain ones
  (encoded together in one right-padded encoder pass) gives transformers'
  `generate(attention_mask=source != pad)` hypotheses token for token (the encoder's key
  mask, the padding position row and the cross-attention mask).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.model_engine.beam import BeamParams, BeamRequest, BeamSearchDriver
from metrale.model_engine.encdec_model import load_encoder_decoder
from metrale.models.m2m100 import CrossBatch, CrossKv
from tests.helpers import m2m100 as tiny

EOS = 2


def _cross(gen: torch.Generator, layers: int, heads: int, length: int, dim: int,
           pads: tuple[int, ...] = ()) -> CrossKv:  # fmt: skip
    kv = [
        (torch.randn(heads, length, dim, generator=gen), torch.randn(heads, length, dim, generator=gen))
        for _ in range(layers)
    ]  # fmt: skip
    if not pads:
        return CrossKv(kv, None)
    mask = torch.zeros(length, dtype=torch.bool)
    mask[list(pads)] = True
    return CrossKv(kv, mask, pads)


def test_cross_batch_equals_each_request_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, dim = 4, 8
    crosses = [
        _cross(gen, 2, heads, 5, dim),
        _cross(gen, 2, heads, 9, dim, pads=(3, 4)),
        _cross(gen, 2, heads, 1, dim),
        _cross(gen, 2, heads, 9, dim),
    ]
    counts = [3, 1, 4, 2]
    groups, start = [], 0
    for c, n in zip(crosses, counts, strict=True):
        groups.append((start, start + n, c))
        start += n
    q = torch.randn(start, heads, dim, generator=gen)
    batch = CrossBatch(groups, q.device)
    for layer in range(2):
        got = batch.attend(q, layer, 0.3)
        for s, e, c in groups:
            k, v = c.layers[layer]
            mask = None if c.pad_mask is None else ~c.pad_mask[None, None, None, :]
            want = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=0.3
            )[0].transpose(0, 1)
            torch.testing.assert_close(got[s:e], want, atol=1e-6, rtol=1e-5)
            alone = CrossBatch([(0, e - s, c)], q.device).attend(q[s:e], layer, 0.3)
            torch.testing.assert_close(alone, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="in order"):
        CrossBatch([(0, 2, crosses[0]), (3, 4, crosses[1])], q.device)
    with pytest.raises(ValueError, match="in order"):
        CrossBatch([], q.device)


def test_sources_with_pad_tokens_match_transformers() -> None:
    variant = tiny.NLLB_STYLE
    path = tiny.build(variant)
    hf = tiny.load_hf(path)
    model = load_encoder_decoder(path, num_blocks=200, block_size=4)
    src, tgt = variant.lang_id("eng_Latn"), variant.lang_id("fra_Latn")
    pad = tiny.PAD_ID
    sources = [
        [src, 40, 41, pad, 42, 43, 44, EOS],
        [src, 50, 51, 52, EOS],
        [src, 60, pad, pad, 61, EOS],
    ]
    params = BeamParams(num_beams=4, max_tokens=8, early_stopping=True)
    reqs = [BeamRequest(f"p{i}", [EOS], params, s, [tgt]) for i, s in enumerate(sources)]
    outs = BeamSearchDriver(model, [EOS]).run(reqs)
    for s, out in zip(sources, outs, strict=True):
        ids = torch.tensor([s])
        ref = hf.generate(
            ids, attention_mask=ids.ne(pad).long(), num_beams=4, max_new_tokens=9,
            early_stopping=True, forced_bos_token_id=tgt, do_sample=False,
        )[0].tolist()[2:]  # fmt: skip
        if EOS in ref:
            ref = ref[: ref.index(EOS) + 1]
        assert out.hypotheses[0].token_ids == ref, s
    assert (model.encoder_passes, model.encoder_batches) == (3, 1)  # one padded encoder pass
    assert model.block_pool.num_free == model.block_pool.num_usable
