"""Turning a chat's image parts into a prompt the model can serve: decoding (with limits),
the checkpoint's image processor, the pad-token expansion and the M-RoPE positions.

Owner: engine. `VisionPrompts` belongs to an engine whose model has a vision tower; the
offline `LLM.chat` and the server both go through it (the server decodes in its own process
and ships the resulting `VisionInputs` with the request).

Invariants:
- A message part is an image when its type is `image_url` (a `data:` URL; anything else must
  be fetched by the caller first: the engine never touches the network), `image` (a PIL
  image, bytes, or a `data:` URL / base64 string), or `input_image`; the chat template sees
  `{"type": "image"}` in its place.
- Each image placeholder (`<|image_pad|>`) the template wrote is expanded to the image's
  token count, in message order; a prompt whose placeholder count differs from its image
  count is refused naming both.
- Per-request limits (`VisionLimits`) are checked before any pixel is decoded where the size
  is known from the header, and every violation is an `InvalidRequestError` naming the limit.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.model_engine.vision import VisionInputs, VisionItem, content_digest, mrope_positions
from metrale.models.qwen_vl import VisionConfig
from metrale.models.vision_processor import ImageLimits, QwenVLImageProcessor, decode_image

IMAGE_PART_TYPES = ("image_url", "image", "input_image")


@dataclass(frozen=True)
class VisionLimits:
    """Per-request limits on images (the server's flags set them)."""

    max_images: int = 16
    image: ImageLimits = field(default_factory=ImageLimits)
    #: Sum of all the request's images' encoded bytes.
    max_total_bytes: int = 64 * 2**20


def decode_data_url(url: str, what: str) -> bytes:
    """The bytes of a `data:[<type>];base64,<payload>` URL."""
    if not url.startswith("data:"):
        raise InvalidRequestError(f"{what}: expected a data: URL", param="messages")
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise InvalidRequestError(
            f"{what}: a data: URL must be base64-encoded ('data:image/png;base64,...')",
            param="messages",
        )
    return decode_base64(payload, what)


def decode_base64(payload: str, what: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"{what}: invalid base64 ({exc})", param="messages") from exc


def _part_image(part: Mapping[str, Any], what: str) -> Any:
    """bytes or a PIL image from one image part."""
    kind = part.get("type")
    value: Any
    if kind == "image_url" or (kind is None and "image_url" in part):
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, Mapping) else value
    elif kind == "input_image":
        value = part.get("image_url")
    else:
        value = part.get("image")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if hasattr(value, "convert") and hasattr(value, "size"):  # a PIL image
        return value
    if isinstance(value, str):
        if value.startswith("data:"):
            return decode_data_url(value, what)
        if value.startswith(("http://", "https://")):
            raise InvalidRequestError(
                f"{what}: remote image URLs are not fetched here (the server fetches them only "
                "from --allowed-media-domains); send the image as a data: URL",
                param="messages",
            )
        if kind == "image":
            return decode_base64(value, what)
    raise InvalidRequestError(f"{what}: no image data (a data: URL or bytes)", param="messages")


def split_media(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[Any]]:
    """`(messages for the chat template, images in order)`: image parts become
    `{"type": "image"}` and their data (bytes or PIL images) is collected."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and (
                part.get("type") in IMAGE_PART_TYPES or "image_url" in part
            ):
                images.append(_part_image(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list)
        and any(
            isinstance(p, Mapping) and (p.get("type") in IMAGE_PART_TYPES or "image_url" in p)
            for p in m["content"]
        )
        for m in messages
    )


class VisionPrompts:
    """Images -> pad tokens, `VisionInputs`, for one checkpoint."""

    def __init__(
        self,
        model_dir: str | Path,
        config: VisionConfig,
        limits: VisionLimits | None = None,
        max_pixels: int | None = None,
        allowed_media_domains: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.limits = limits or VisionLimits()
        #: Hosts (with their subdomains) the server may fetch http(s) image URLs from.
        self.allowed_media_domains = tuple(
            d.strip().lower().strip(".") for d in allowed_media_domains if d.strip()
        )
        self.processor = QwenVLImageProcessor.from_checkpoint(model_dir, max_pixels=max_pixels)
        if self.processor.merge_size != config.spatial_merge_size:
            raise InvalidRequestError(
                f"preprocessor merge_size {self.processor.merge_size} differs from the model's "
                f"spatial_merge_size {config.spatial_merge_size}"
            )

    def decode(self, images: Sequence[Any]) -> list[Any]:
        """PIL images from bytes (or PIL images passed through), with the request's limits."""
        limits = self.limits
        if len(images) > limits.max_images:
            raise InvalidRequestError(
                f"{len(images)} images in one request, over the limit of {limits.max_images} "
                "(--max-images-per-request)",
                param="messages",
            )
        total = sum(len(im) for im in images if isinstance(im, bytes))
        if total > limits.max_total_bytes:
            raise InvalidRequestError(
                f"the request's images total {total} bytes, over the limit of "
                f"{limits.max_total_bytes} bytes per request (--max-image-bytes-per-request)",
                param="messages",
            )
        out = []
        for i, im in enumerate(images):
            if isinstance(im, bytes):
                out.append(decode_image(im, limits.image, f"image {i}"))
            else:
                w, h = im.size
                if w * h > limits.image.max_pixels:
                    raise InvalidRequestError(
                        f"image {i} is {w}x{h} = {w * h} pixels, over the limit of "
                        f"{limits.image.max_pixels} pixels per image (--max-image-pixels)",
                        param="messages",
                    )
                out.append(im if im.mode == "RGB" else im.convert("RGB"))
        return out

    def build(
        self, token_ids: Sequence[int], images: Sequence[Any]
    ) -> tuple[list[int], VisionInputs]:
        """Expand each image placeholder of `token_ids` to its image's tokens."""
        cfg = self.config
        pad = cfg.image_token_id
        slots = [i for i, t in enumerate(token_ids) if t == pad]
        if len(slots) != len(images):
            raise InvalidRequestError(
                f"the prompt holds {len(slots)} image placeholders but {len(images)} images "
                "were given",
                param="messages",
            )
        pil = self.decode(images)
        ids: list[int] = []
        items: list[VisionItem] = []
        cursor = 0
        for slot, image in zip(slots, pil, strict=True):
            pixels, grid = self.processor.process(image)
            count = grid[0] * grid[1] * grid[2] // cfg.merge_unit
            ids.extend(token_ids[cursor:slot])
            items.append(
                VisionItem(content_digest(pixels, grid), "image", pixels, grid, len(ids), count)
            )
            ids.extend([pad] * count)
            cursor = slot + 1
        ids.extend(token_ids[cursor:])
        positions, delta = mrope_positions(len(ids), items, cfg.spatial_merge_size)
        return ids, VisionInputs(items, positions, delta, frozenset({pad, cfg.video_token_id}))


def vision_prompts_for(config: Any, model_dir: str | Path, model: Any) -> VisionPrompts | None:
    """The engine's `VisionPrompts` when its model has a vision tower (else None), with the
    request limits of `config` (an `EngineConfig`)."""
    module = getattr(model, "module", None)
    vcfg = getattr(module, "vision_config", None)
    if not isinstance(vcfg, VisionConfig):
        return None
    limits = VisionLimits(
        max_images=config.max_images_per_request,
        image=ImageLimits(max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels),
        max_total_bytes=config.max_images_per_request * config.max_image_bytes,
    )
    domains = (config.allowed_media_domains or "").split(",")
    return VisionPrompts(model_dir, vcfg, limits, allowed_media_domains=domains)


def check_vision(vision: Any, ids: Sequence[int], supported: bool) -> None:
    """A request's `VisionInputs` fits its prompt (and the model takes images at all)."""
    if not supported:
        raise InvalidRequestError("this model does not take image input", param="messages")
    if not isinstance(vision, VisionInputs) or vision.prompt_len != len(ids):
        raise InvalidRequestError(
            "the request's images do not match its prompt (build them with Engine.vision.build)",
            param="messages",
        )
    for item in vision.items:
        span = ids[item.offset : item.offset + item.num_tokens]
        if len(span) != item.num_tokens or any(t not in vision.pad_token_ids for t in span):
            raise InvalidRequestError(
                f"image {item.digest[:12]} does not sit on image pad tokens of the prompt",
                param="messages",
            )
