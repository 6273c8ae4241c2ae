"""The engine around vision input (tiny Qwen2.5-VL, float32 CPU): prefix-cache keys carry
the image hash, preemption of a vision sequence recomputes (or swaps) exactly, and bad image
input is refused by name with the engine still serving.

Owner: tests (engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import InvalidRequestError
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.vision import IMAGE_PAD, build_qwen25_vl, chat, data_url, hf_greedy, png_bytes


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


@pytest.fixture(scope="module")
def path() -> Path:
    return build_qwen25_vl()


def test_prefix_cache_keys_carry_the_image(path: Path) -> None:
    """Same text, same-sized images: a different image shares only the text before it; the
    same image again reuses every full block; answers stay transformers'."""
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    first = chat("def f(x):", [(40, 28, 1)])
    other = chat("def f(x):", [(40, 28, 7)])
    (a,) = llm.chat(first, greedy(8))
    ids = a.prompt_token_ids
    start = ids.index(IMAGE_PAD)
    (b,) = llm.chat(other, greedy(8))
    assert b.prompt_token_ids == ids
    assert start - 4 < b.num_cached_tokens <= start  # the text before the image, not the image
    assert b.outputs[0].token_ids == hf_greedy(path, ids, [(40, 28, 7)], 8)
    assert b.outputs[0].token_ids != a.outputs[0].token_ids
    (again,) = llm.chat(first, greedy(8))
    assert again.num_cached_tokens == (len(ids) - 1) // 4 * 4 > start + 20  # past the image
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_vision_sequences_resume_exactly(path: Path, mode: str) -> None:
    """A pool too small for four two-image prompts preempts; a recomputed sequence re-reads
    its images (from the encoder cache or re-encoded) and continues M-RoPE positions past the
    prompt, so every answer is still transformers'."""
    images = [[(40, 28, s), (23, 61, s + 10)] for s in range(4)]
    llm = LLM(
        str(path), device="cpu", dtype="float32", num_kv_blocks=18, max_num_seqs=4,
        preemption_mode=mode,
    )  # fmt: skip
    outs = llm.chat([chat("def f(x):", ims) for ims in images], greedy(48))
    stats = llm.engine.scheduler.stats
    assert stats.preemptions_recompute + stats.preemptions_swap > 0
    for out, ims in zip(outs, images, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, ims, 48)
    assert_no_leaks(llm.engine)


def test_bad_images_are_refused_by_name(path: Path) -> None:
    llm = LLM(
        str(path), device="cpu", dtype="float32", num_kv_blocks=32, max_image_pixels=64 * 64,
        max_images_per_request=2,
    )  # fmt: skip
    png = png_bytes(40, 28, 1)

    def ask(url: str, n: int = 1) -> None:
        parts = [{"type": "image_url", "image_url": {"url": url}}] * n
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}])

    cases = [
        (data_url(png[: len(png) // 2]), "truncated"),
        (data_url(b"this is not an image"), "not a decodable image"),
        (data_url(png_bytes(80, 70, 2)), "--max-image-pixels"),
        ("https://example.com/cat.png", "--allowed-media-domains"),
        ("data:image/png;base64,@@@", "invalid base64"),
    ]
    for url, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            ask(url)
    with pytest.raises(InvalidRequestError, match="--max-images-per-request"):
        ask(data_url(png), 3)
    assert not llm.engine.has_unfinished()
    (ok,) = llm.chat(chat("def f(x):", [(40, 28, 1)]), greedy(4))
    assert ok.outputs[0].token_ids == hf_greedy(path, ok.prompt_token_ids, [(40, 28, 1)], 4)
    assert_no_leaks(llm.engine)


def test_text_only_model_refuses_images() -> None:
    from tests.helpers.checkpoints import DENSE_VARIANTS, build

    llama = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
    llm = LLM(str(build(llama)), device="cpu", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="does not take image input"):
        llm.chat(chat("hi", [(8, 8, 0)]))


def test_video_limits_and_qwen3_vl_video_are_refused_by_name() -> None:
    from tests.helpers.vision import build_qwen3_vl, pil_image

    frames = [pil_image(16, 16, s) for s in range(5)]
    video = [{"role": "user", "content": [{"type": "video", "video": frames}]}]
    short = LLM(str(build_qwen25_vl()), device="cpu", num_kv_blocks=32, max_video_frames=4)
    with pytest.raises(InvalidRequestError, match="--max-video-frames"):
        short.chat(video)
    qwen3 = LLM(str(build_qwen3_vl()), device="cpu", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError, match="does not take video input"):
        qwen3.chat(video)
    assert not short.engine.has_unfinished() and not qwen3.engine.has_unfinished()
