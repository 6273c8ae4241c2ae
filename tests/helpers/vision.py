"""Tiny random vision-language checkpoints (Qwen2.5-VL, Qwen3-VL) written by transformers, and test images.

Owner: tests. `build_qwen25_vl()` writes a real checkpoint directory: config.json +
model.safetensors from transformers, the tiny tokenizer with Qwen's vision tokens added
(<|vision_start|> 512, <|vision_end|> 513, <|image_pad|> 514, <|video_pad|> 515), a chat
template that renders image parts as Qwen's does, and a preprocessor_config.json with a small
patch grid so images of a few dozen pixels become a few dozen tokens.

Invariants:
- `build_qwen3_vl()` is the same for Qwen3-VL (q/k-norm decoder, interleaved M-RoPE, learned
  vision positions, DeepStack at tower blocks 0 and 2).
- Deterministic (seeded weights, seeded images); built once per process into a temporary
  directory removed at exit.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.tiny_tokenizer import copy_tokenizer_into

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 512, 513, 514, 515

VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 8 * 8,
    "max_pixels": 48 * 48,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def qwen25_vl_config() -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]},
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
        ),
        vision_config=dict(
            depth=4, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, window_size=16,
            fullatt_block_indexes=[1, 3], out_hidden_size=64, in_channels=3, tokens_per_second=2,
        ),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )  # fmt: skip


def qwen3_vl_config() -> Any:
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
        ),
        vision_config=dict(
            depth=4, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, in_channels=3,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 2],
            hidden_act="gelu_pytorch_tanh",
        ),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )  # fmt: skip


def qwen3_vl_moe_config() -> Any:
    from transformers import Qwen3VLMoeConfig

    dense = qwen3_vl_config()
    text = dense.text_config.to_dict()
    text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                decoder_sparse_step=1)  # fmt: skip
    for key in ("model_type", "architectures", "transformers_version"):
        text.pop(key, None)
    vision = dense.vision_config.to_dict()
    for key in ("model_type", "transformers_version"):
        vision.pop(key, None)
    return Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )  # fmt: skip


def _add_vision_tokens(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    for i, t in enumerate(VISION_TOKENS):
        assert tok.token_to_id(t) == VISION_START + i, (t, tok.token_to_id(t))
    tok.save(str(out / "tokenizer.json"))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    decoder = cfg.setdefault("added_tokens_decoder", {})
    for i, t in enumerate(VISION_TOKENS):
        decoder[str(VISION_START + i)] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }  # fmt: skip
    cfg["additional_special_tokens"] = [*cfg.get("additional_special_tokens", []), *VISION_TOKENS]
    cfg["chat_template"] = VL_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def build_qwen25_vl() -> Path:
    return build_vl("qwen2_5_vl")


def build_qwen3_vl() -> Path:
    return build_vl("qwen3_vl")


def build_qwen3_vl_moe() -> Path:
    return build_vl("qwen3_vl_moe")


@functools.cache
def build_vl(kind: str) -> Path:
    """A tiny random checkpoint of `kind` ("qwen2_5_vl" or "qwen3_vl")."""
    import torch
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    out = Path(tempfile.mkdtemp(prefix=f"metrale-tiny-{kind}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    torch.manual_seed(0)
    if kind == "qwen2_5_vl":
        model = Qwen2_5_VLForConditionalGeneration(qwen25_vl_config())
    elif kind == "qwen3_vl":
        model = Qwen3VLForConditionalGeneration(qwen3_vl_config())
    else:
        model = Qwen3VLMoeForConditionalGeneration(qwen3_vl_moe_config())
    with torch.no_grad():  # random weights large enough that images move the logits
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    copy_tokenizer_into(out)
    _add_vision_tokens(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return out


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A seeded random RGB image of that size, PNG-encoded."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def pil_image(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(png_bytes(width, height, seed))).convert("RGB")


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(
    text: str, images: list[tuple[int, int, int]], tail: str = " return"
) -> list[dict[str, Any]]:
    """One user message: `text`, then each `(width, height, seed)` image followed by `tail`."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for w, h, s in images:
        content.append({"type": "image_url", "image_url": {"url": data_url(png_bytes(w, h, s))}})
        content.append({"type": "text", "text": tail})
    return [{"role": "user", "content": content}]


@functools.cache
def _hf_model(path: Path) -> Any:
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def hf_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    keys = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")
    return Qwen2VLImageProcessorPil(**{k: PREPROCESSOR[k] for k in keys})


def hf_greedy(
    path: Path, prompt_ids: list[int], images: list[tuple[int, int, int]], max_new: int
) -> list[int]:
    """transformers' greedy continuation of `prompt_ids` (already expanded) with the images
    preprocessed by transformers' own processor."""
    import torch

    kwargs: dict[str, Any] = {}
    if images:
        pixels = hf_processor()([pil_image(*im) for im in images], return_tensors="pt")
        kwargs = dict(
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(torch.tensor([prompt_ids]) == IMAGE_PAD).int(),
        )
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = _hf_model(path).generate(
            ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, **kwargs
        )
    return out[0, len(prompt_ids) :].tolist()


def gif_bytes(sizes: tuple[int, int], durations_ms: list[int], seed: int = 0) -> bytes:
    """An animated GIF of random frames with the given per-frame durations."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = sizes
    frames = [
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), "RGB").quantize(64)
        for _ in durations_ms
    ]
    buf = io.BytesIO()
    frames[0].save(
        buf, format="GIF", save_all=True, append_images=frames[1:], duration=durations_ms, loop=0
    )
    return buf.getvalue()


def hf_greedy_video(
    path: Path,
    prompt_ids: list[int],
    pixels: Any,
    grid: tuple[int, int, int],
    seconds: float,
    max_new: int,
) -> list[int]:
    """transformers' greedy continuation with one video given as patches (metrale's, since
    transformers' video processor needs torchvision) and `seconds` per temporal patch."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = _hf_model(path).generate(
            ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
            pixel_values_videos=torch.from_numpy(pixels), video_grid_thw=torch.tensor([grid]),
            second_per_grid_ts=torch.tensor([seconds]),
            mm_token_type_ids=(ids == VIDEO_PAD).int() * 2,
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
