"""Translation over HTTP (an NLLB-style tiny checkpoint): `/v1/completions` and
`/v1/chat/completions` with `src_lang` / `tgt_lang` / `num_beams` give the offline
`Translator`'s hypotheses; `num_beams` 1 is transformers' greedy decoding; an unknown language
code, a bad field and `stream` are 400s naming them; concurrent requests share the driver and
every block is free afterwards."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from metrale.engine.translate import TranslationService, Translator
from metrale.model_engine.beam import BeamParams
from metrale.server.translation import beam_params, create_translation_app
from tests.helpers import m2m100 as tiny

VARIANT = tiny.NLLB_STYLE
TEXTS = ["def main():", "import os", "return x + 1", "class A:"]


@pytest.fixture(scope="module")
def translator() -> Translator:
    return Translator(tiny.build(VARIANT), num_kv_blocks=400, block_size=4)


def test_completions_and_chat_match_offline(translator: Translator) -> None:
    service = TranslationService(translator)
    app = create_translation_app(service, model_name="tiny-nllb")
    params = BeamParams(num_beams=4, n=2, length_penalty=0.8, early_stopping="never", max_tokens=9)
    offline = translator.translate(TEXTS, "eng_Latn", "fra_Latn", params)
    body = {"src_lang": "eng_Latn", "tgt_lang": "fra_Latn", "num_beams": 4, "n": 2,
            "length_penalty": 0.8, "early_stopping": "never", "max_tokens": 9}  # fmt: skip
    with TestClient(app) as client:
        with ThreadPoolExecutor(4) as pool:  # concurrent requests share decoder forwards
            replies = list(
                pool.map(
                    lambda t: client.post("/v1/completions", json={**body, "prompt": t}), TEXTS
                )
            )
        for reply, want in zip(replies, offline, strict=True):
            assert reply.status_code == 200, reply.text
            choices = reply.json()["choices"]
            assert [c["text"] for c in choices] == [c.text for c in want.outputs]
            assert [c["beam_score"] for c in choices] == pytest.approx(
                [c.cumulative_logprob for c in want.outputs]
            )
        chat = client.post(
            "/v1/chat/completions",
            json={**body, "messages": [{"role": "user", "content": TEXTS[1]}]},
        )
        assert chat.status_code == 200
        assert [c["message"]["content"] for c in chat.json()["choices"]] == [
            c.text for c in offline[1].outputs
        ]
        batch = client.post("/v1/completions", json={**body, "n": 1, "prompt": TEXTS[:2]})
        assert [c["text"] for c in batch.json()["choices"]] == [
            o.outputs[0].text for o in offline[:2]
        ]
    pool_ = translator.model.block_pool
    assert pool_.num_free == pool_.num_usable


def test_bad_requests_are_400s_naming_the_field(translator: Translator) -> None:
    app = create_translation_app(TranslationService(translator), model_name="tiny-nllb")
    base = {"prompt": "x", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"}
    with TestClient(app) as client:
        for patch, param, words in (
            ({"tgt_lang": "klingon"}, "tgt_lang", "klingon"),
            ({"src_lang": "xx_Latn"}, "src_lang", "xx_Latn"),
            ({"stream": True}, "stream", "stream"),
            ({"num_beams": 0}, "num_beams", "num_beams"),
            ({"early_stopping": "soon"}, "early_stopping", "soon"),
            ({"n": 3, "num_beams": 2}, "n", "num_beams"),
        ):
            reply = client.post("/v1/completions", json={**base, **patch})
            assert reply.status_code == 400, patch
            err = reply.json()["error"]
            assert err["param"] == param and words in err["message"], err
        missing = client.post("/v1/completions", json={"prompt": "x", "src_lang": "eng_Latn"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "tgt_lang"


def test_one_beam_is_greedy_decoding(translator: Translator) -> None:
    hf = tiny.load_hf(tiny.build(VARIANT))
    params = beam_params({"num_beams": 1, "max_tokens": 10})
    tgt = VARIANT.lang_id("deu_Latn")
    for text in TEXTS:
        req = translator.request(text, "eng_Latn", "deu_Latn", params)
        ours = translator.run([req])[0].hypotheses[0].token_ids
        ref = hf.generate(torch.tensor([req.source]), num_beams=1, do_sample=False,
                          max_new_tokens=11, forced_bos_token_id=tgt)[0].tolist()[2:]  # fmt: skip
        assert ours == ref[: len(ours)] and all(t == 1 for t in ref[len(ours) :])


def test_cancel_and_shutdown_free_every_block(translator: Translator) -> None:
    service = TranslationService(translator)
    params = BeamParams(num_beams=4, max_tokens=60, early_stopping="never")
    pool = translator.model.block_pool
    slow = service.submit(TEXTS, "eng_Latn", "fra_Latn", params)
    service.cancel(slow)
    done = service.submit(TEXTS[:1], "eng_Latn", "fra_Latn", BeamParams(num_beams=2, max_tokens=4))
    assert len(done.result(timeout=60)) == 1
    deadline = time.monotonic() + 60
    while service.driver.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slow.cancelled()
    pending = service.submit(TEXTS, "eng_Latn", "fra_Latn", params)
    service.shutdown()
    assert pending.cancelled() or pending.done()
    assert not service.driver.has_unfinished()
    assert pool.num_free == pool.num_usable
