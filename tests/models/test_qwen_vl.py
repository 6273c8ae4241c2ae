"""Qwen2.5-VL and Qwen3-VL against transformers on tiny random checkpoints, float32 CPU: the
image processor, the vision towers (DeepStack levels included), and greedy tokens through
`LLM.chat` with 0, 1 and 2 images of different sizes, whole and with prefill chunks cutting
through the images.

Owner: tests (models).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.models.vision_processor import QwenVLImageProcessor
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.vision import (
    IMAGE_PAD,
    build_qwen3_vl,
    build_qwen25_vl,
    build_vl,
    chat,
    hf_greedy,
    hf_processor,
    pil_image,
)

IMAGES = [(40, 28, 1), (23, 61, 2)]  # (width, height, seed): 20 and 24 tokens
MAX_NEW = 10


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def path() -> Path:
    return build_qwen25_vl()


def test_processor_matches_transformers(path: Path) -> None:
    ours = QwenVLImageProcessor.from_checkpoint(path)
    # as is, resized down (over max_pixels), resized up (under min_pixels), odd sizes
    sizes = [(40, 28, 1), (100, 90, 3), (5, 7, 4), (23, 61, 2)]
    images = [pil_image(*s) for s in sizes]
    ref = hf_processor()(images, return_tensors="np")
    got = [ours.process(im) for im in images]
    assert [g[1] for g in got] == [tuple(r) for r in ref["image_grid_thw"].tolist()]
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), ref["pixel_values"])


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_matches_transformers(kind: str) -> None:
    path = build_qwen25_vl() if kind == "qwen2_5_vl" else build_qwen3_vl()
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16)
    module = llm.engine.model.module
    proc = QwenVLImageProcessor.from_checkpoint(path)
    done = [proc.process(pil_image(*s)) for s in [(40, 28, 1), (100, 90, 3), (23, 61, 2)]]
    pixels = torch.from_numpy(np.concatenate([d[0] for d in done]))
    grids = [d[1] for d in done]
    from tests.helpers.vision import _hf_model

    with torch.no_grad():
        features = _hf_model(path).model.get_image_features(pixels, torch.tensor(grids))
        together = module.encode_images(pixels, grids)
        alone = module.encode_images(torch.from_numpy(done[1][0]), [grids[1]])
    levels = [features.pooler_output, *(getattr(features, "deepstack_features", None) or [])]
    levels = [torch.cat(list(x)) if isinstance(x, (tuple, list)) else x for x in levels]
    ref = torch.cat(levels, dim=-1)  # the merger's rows, then each DeepStack level's
    torch.testing.assert_close(torch.cat(together), ref, atol=2e-5, rtol=1e-4)
    assert ref.shape[-1] == 64 * (1 if kind == "qwen2_5_vl" else 3)
    torch.testing.assert_close(alone[0], together[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_chat_greedy_matches_transformers(kind: str, chunk: int | None) -> None:
    """0, 1 and 2 images in one batch; with `chunk` 8 every image is cut by chunk edges.
    Qwen3-VL adds q/k norm, interleaved M-RoPE, learned vision positions and DeepStack;
    Qwen3-VL-MoE its sparse decoder (router renormalised over the top k)."""
    path = build_vl(kind)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_prefill_chunk=chunk)
    convs = [chat("def f(x):", IMAGES[:n]) for n in range(3)]
    outs = llm.chat(convs, greedy())
    for n, out in enumerate(outs):
        ids = out.prompt_token_ids
        assert sum(t == IMAGE_PAD for t in ids) == [0, 20, 44][n]
        assert out.outputs[0].token_ids == hf_greedy(path, ids, IMAGES[:n], MAX_NEW), n
    # Two distinct images (prompts 1 and 2 share the first): each encoded once; with chunks
    # every image cut by a chunk edge is read again from the encoder cache.
    stats = llm.engine.model.vision_stats
    assert stats["images_encoded"] == 2
    if chunk:
        assert stats["encoder_cache_hits"] >= 3
    assert_no_leaks(llm.engine)


def test_images_change_the_answer(path: Path) -> None:
    """The parity above cannot pass by ignoring the pixels: another image of the same size
    (same prompt tokens) gives other tokens here, as in transformers."""
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    a, b = llm.chat([chat("def f(x):", [(40, 28, 1)]), chat("def f(x):", [(40, 28, 7)])], greedy())
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    assert b.outputs[0].token_ids == hf_greedy(path, b.prompt_token_ids, [(40, 28, 7)], MAX_NEW)


def test_video_frames_and_gif_match_transformers() -> None:
    """A video as a list of frames (3, padded to 4 for the temporal patches) and as a GIF
    decoded in-process and sampled at --video-fps: the temporal M-RoPE positions step by
    tokens_per_second x seconds per patch, as transformers' Qwen2.5-VL does."""
    from metrale.engine.vision import sample_gif
    from metrale.models.vision_processor import ImageLimits
    from tests.helpers.vision import VIDEO_PAD, gif_bytes, hf_greedy_video

    path = build_qwen25_vl()
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, video_fps=2.0)
    frames = [pil_image(24, 16, s) for s in (5, 6, 7)]
    gif = gif_bytes((24, 16), [250, 250, 500, 500], seed=3)  # 1.5 s: 3 frames at 2 fps
    sampled = sample_gif(gif, 2.0, ImageLimits(), "gif")
    assert len(sampled) == 3
    proc = QwenVLImageProcessor.from_checkpoint(path)
    for video, source in ((frames, frames), (data_url_gif(gif), sampled)):
        messages = [
            {"role": "user", "content": [
                {"type": "text", "text": "def f(x):"},
                {"type": "video", "video": video} if isinstance(video, list)
                else {"type": "video_url", "video_url": {"url": video}},
                {"type": "text", "text": " return"},
            ]}
        ]  # fmt: skip
        (out,) = llm.chat(messages, greedy())
        ids = out.prompt_token_ids
        pixels, grid = proc.process_frames(source)
        assert grid[0] == 2 and sum(t == VIDEO_PAD for t in ids) == 2 * grid[1] * grid[2] // 4
        seconds = proc.temporal_patch_size / 2.0
        assert out.outputs[0].token_ids == hf_greedy_video(
            path, ids, pixels, grid, seconds, MAX_NEW
        )


def data_url_gif(data: bytes) -> str:
    from tests.helpers.vision import data_url

    return data_url(data, "image/gif")
