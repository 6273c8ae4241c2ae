"""The engine around vision input (tiny Qwen2.5-VL, float32 CPU): prefix-cache keys carry
the image hash, preemption of a vision sequence recomputes (or swaps) exactly, and bad image
input is refused by name with the engine still serving.

Owner: tests (engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.vision import split_media
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


def test_decode_graphs_get_shifted_rotary_positions(path: Path) -> None:
    """CUDA's decode graphs (staging checked on the CPU, the graph body stubbed): a row after
    an image gets `seq_len + delta` as its rotary position, while its KV slot and length
    follow `seq_len`."""
    import torch

    from metrale.model_engine.cuda_graphs import DecodeGraphRunner

    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    model = llm.engine.model
    runner = DecodeGraphRunner(model.module, model.kv_cache.layers, model.device, 4, 32, 16)
    vocab = model.config.vocab_size
    runner._body = lambda rows: torch.zeros(rows, vocab)  # type: ignore[method-assign]
    calls: list[tuple[list[int], list[int] | None]] = []
    real_run = runner.run

    def spy(
        tokens, positions, tables, feed=None, adapter_slots=None, rope_positions=None,
        ssm_slots=None,
    ):  # fmt: skip
        calls.append(
            (positions.tolist(), None if rope_positions is None else rope_positions.tolist())
        )
        out = real_run(
            tokens, positions, tables, feed, adapter_slots=adapter_slots,
            rope_positions=rope_positions, ssm_slots=ssm_slots,
        )  # fmt: skip
        rope = positions if rope_positions is None else rope_positions
        assert runner.positions[: len(tokens)].tolist() == rope.tolist()
        assert runner.seq_lens[: len(tokens)].tolist() == (positions + 1).tolist()
        slots = [int(tables[i, p // 16]) * 16 + p % 16 for i, p in enumerate(positions)]
        assert runner.slot_mapping[: len(tokens)].tolist() == slots
        return out

    runner.run = spy  # type: ignore[method-assign]
    model.graph_runner = runner
    with_image = chat("def f(x):", [(40, 28, 1)])
    llm.chat([with_image, chat("def f(x):", [])], greedy(3))
    messages, media = split_media(with_image)
    tok = llm.get_tokenizer()
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    assert llm.engine.vision is not None
    delta = llm.engine.vision.build(ids, media)[1].delta
    assert delta < 0
    shifted = [c for c in calls if c[1] is not None]
    assert shifted
    for pos, rope in shifted:
        offsets = {r - p for r, p in zip(rope, pos, strict=True)}
        assert delta in offsets and offsets <= {delta, 0}
    assert model.vision_stats["graphed_shifted_decodes"] == len(shifted)


def test_pad_tokens_without_images_are_refused(path: Path) -> None:
    llm = LLM(str(path), device="cpu", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="pad tokens but no images"):
        llm.generate([[4, 20, IMAGE_PAD, 30]])
    (ok,) = llm.generate([[4, 20, 30]], greedy(2))
    assert len(ok.outputs[0].token_ids) == 2
