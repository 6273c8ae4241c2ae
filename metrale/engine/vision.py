"""Turning a chat's image and video parts into a prompt the model can serve: decoding (with
limits), the checkpoint's image processor, the pad-token expansion and the M-RoPE positions.

Owner: engine. `VisionPrompts` belongs to an engine whose model has a vision tower; the
offline `LLM.chat` and the server both go through it (the server decodes in its own process
and ships the resulting `VisionInputs` with the request).

Invariants:
- A message part is an image when its type is `image_url` (a `data:` URL; anything else must
  be fetched by the caller first: the engine never touches the network), `image` (a PIL
  image, bytes, or a `data:` URL / base64 string), or `input_image`; the chat template sees
  `{"type": "image"}` in its place.
- A video part is `video_url` (a `data:` URL of a GIF, decoded in-process and sampled at
  `video_fps`: at each `k / fps` seconds, the frame showing then) or `video` (a list of
  frames taken to be `1 / video_fps` apart); consecutive frames pair into temporal patches
  (the last repeats to fill one), and temporal M-RoPE positions step by
  `tokens_per_second x temporal_patch_size / video_fps` (Qwen2.5-VL; Qwen3-VL's timestamped
  video layout is not built and is refused by name).
- Each image placeholder (`<|image_pad|>`) the template wrote is expanded to the image's
  token count (video placeholders likewise), images and videos each in message order; a
  prompt whose placeholder counts differ from its media counts is refused naming both.
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
from metrale.models.qwen_vl_vision import VisionConfig
from metrale.models.vision_processor import ImageLimits, QwenVLImageProcessor, decode_image

IMAGE_PART_TYPES = ("image_url", "image", "input_image")
VIDEO_PART_TYPES = ("video_url", "video")


@dataclass
class Video:
    """A video part: encoded bytes (a GIF, decoded here) or its frames (PIL images / bytes),
    taken as sampled at the engine's `--video-fps`."""

    data: bytes | None = None
    frames: list[Any] | None = None


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


def _part_video(part: Mapping[str, Any], what: str) -> Video:
    """A video part: `video_url` (a data: URL of a GIF) or `video` (a list of frames, or the
    encoded bytes / data URL)."""
    value: Any = part.get("video_url", part.get("video"))
    value = value.get("url") if isinstance(value, Mapping) else value
    if isinstance(value, (list, tuple)):
        frames = [
            _part_image({"type": "image", "image": f}, f"{what} frame {k}")
            for k, f in enumerate(value)
        ]
        return Video(frames=frames)
    if isinstance(value, (bytes, bytearray)):
        return Video(data=bytes(value))
    if isinstance(value, str) and value.startswith("data:"):
        return Video(data=decode_data_url(value, what))
    raise InvalidRequestError(
        f"{what}: a video is a data: URL of a GIF or a list of frames", param="messages"
    )


def _media_kind(part: Any) -> str | None:
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind in IMAGE_PART_TYPES or (kind is None and "image_url" in part):
        return "image"
    if kind in VIDEO_PART_TYPES:
        return "video"
    return None


def split_media(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[Any]]:
    """`(messages for the chat template, media in order)`: image parts become
    `{"type": "image"}` (their bytes or PIL images collected), video parts `{"type": "video"}`
    (a `Video` collected)."""
    out: list[dict[str, Any]] = []
    media: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            kind = _media_kind(part)
            what = f"messages[{i}].content[{j}]"
            if kind == "image":
                media.append(_part_image(part, what))
            elif kind == "video":
                media.append(_part_video(part, what))
            parts.append({"type": kind} if kind else part)
        out.append({**message, "content": parts})
    return out, media


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(_media_kind(p) for p in m["content"])
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
        video_fps: float = 2.0,
        max_video_frames: int = 64,
        video: bool = True,
    ) -> None:
        self.config = config
        #: Frames per second a video is sampled at (and its frames are taken to be at).
        self.video_fps = video_fps
        self.max_video_frames = max_video_frames
        #: Whether this model takes video (Qwen3-VL's timestamped video layout is not built).
        self.video = video
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

    def decode(self, media: Sequence[Any]) -> list[Any]:
        """PIL images (and, for a video, its list of sampled frames) from bytes or PIL images
        passed through, with the request's limits."""
        limits = self.limits
        if len(media) > limits.max_images:
            raise InvalidRequestError(
                f"{len(media)} images and videos in one request, over the limit of {limits.max_images} "
                "(--max-images-per-request)",
                param="messages",
            )
        raw = [m for m in media if isinstance(m, bytes)]
        raw += [m.data for m in media if isinstance(m, Video) and m.data is not None]
        raw += [
            f for m in media if isinstance(m, Video) for f in m.frames or () if isinstance(f, bytes)
        ]
        total = sum(len(b) for b in raw)
        if total > limits.max_total_bytes:
            raise InvalidRequestError(
                f"the request's images total {total} bytes, over the limit of "
                f"{limits.max_total_bytes} bytes per request (--max-images-per-request x "
                "--max-image-bytes)",
                param="messages",
            )
        out: list[Any] = []
        for i, m in enumerate(media):
            if isinstance(m, Video):
                out.append(self._frames(m, f"video {i}"))
            else:
                out.append(self._image(m, f"image {i}"))
        return out

    def _image(self, image: Any, what: str) -> Any:
        if isinstance(image, bytes):
            return decode_image(image, self.limits.image, what)
        w, h = image.size
        if w * h > self.limits.image.max_pixels:
            raise InvalidRequestError(
                f"{what} is {w}x{h} = {w * h} pixels, over the limit of "
                f"{self.limits.image.max_pixels} pixels per image (--max-image-pixels)",
                param="messages",
            )
        return image if image.mode == "RGB" else image.convert("RGB")

    def _frames(self, video: Video, what: str) -> list[Any]:
        if not self.video:
            raise InvalidRequestError(
                f"{what}: this model does not take video input here", param="messages"
            )
        if video.frames is not None:
            frames = [self._image(f, f"{what} frame {k}") for k, f in enumerate(video.frames)]
        else:
            assert video.data is not None
            frames = sample_gif(video.data, self.video_fps, self.limits.image, what)
        if not frames:
            raise InvalidRequestError(f"{what} has no frames", param="messages")
        if len(frames) > self.max_video_frames:
            raise InvalidRequestError(
                f"{what} has {len(frames)} frames at {self.video_fps} fps, over the limit of "
                f"{self.max_video_frames} (--max-video-frames)",
                param="messages",
            )
        return frames

    def build(
        self, token_ids: Sequence[int], media: Sequence[Any]
    ) -> tuple[list[int], VisionInputs]:
        """Expand each image / video placeholder of `token_ids` to its tokens: image pads take
        the images in order, video pads the videos in order (as transformers' processor does)."""
        cfg = self.config
        pads = {cfg.image_token_id: "image", cfg.video_token_id: "video"}
        slots = [i for i, t in enumerate(token_ids) if t in pads]
        decoded = self.decode(media)
        images = [d for m, d in zip(media, decoded, strict=True) if not isinstance(m, Video)]
        videos = [d for m, d in zip(media, decoded, strict=True) if isinstance(m, Video)]
        wanted = [pads[token_ids[s]] for s in slots]
        if wanted.count("image") != len(images) or wanted.count("video") != len(videos):
            raise InvalidRequestError(
                f"the prompt holds {wanted.count('image')} image and {wanted.count('video')} "
                f"video placeholders but {len(images)} images and {len(videos)} videos were given",
                param="messages",
            )
        queues = {"image": iter(images), "video": iter(videos)}
        ids: list[int] = []
        items: list[VisionItem] = []
        steps: list[float] = []
        cursor = 0
        for slot in slots:
            kind = pads[token_ids[slot]]
            source = next(queues[kind])
            if kind == "image":
                pixels, grid = self.processor.process(source)
                steps.append(1.0)
            else:
                pixels, grid = self.processor.process_frames(source)
                # seconds per temporal patch, times the model's position ticks per second
                steps.append(
                    cfg.tokens_per_second * self.processor.temporal_patch_size / self.video_fps
                )
            count = grid[0] * grid[1] * grid[2] // cfg.merge_unit
            ids.extend(token_ids[cursor:slot])
            items.append(
                VisionItem(content_digest(pixels, grid), kind, pixels, grid, len(ids), count)
            )
            ids.extend([token_ids[slot]] * count)
            cursor = slot + 1
        ids.extend(token_ids[cursor:])
        positions, delta = mrope_positions(len(ids), items, cfg.spatial_merge_size, steps)
        return ids, VisionInputs(items, positions, delta, frozenset(pads))


def sample_gif(data: bytes, fps: float, limits: ImageLimits, what: str) -> list[Any]:
    """A GIF (or other animated image) decoded in-process and sampled at `fps`: for each time
    `k / fps` within the animation, the frame showing then (frame durations from the file;
    100 ms where a frame gives none)."""
    from PIL import ImageSequence

    animation = decode_image(data, limits, what, keep_open=True)
    frames, starts, t = [], [], 0.0
    for frame in ImageSequence.Iterator(animation):
        starts.append(t)
        t += (frame.info.get("duration") or 100) / 1000.0
        frames.append(frame.convert("RGB"))
    out = []
    k = 0
    while k / fps < t:
        now = k / fps
        index = max(i for i, s in enumerate(starts) if s <= now)
        out.append(frames[index])
        k += 1
    return out


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
    return VisionPrompts(
        model_dir, vcfg, limits, allowed_media_domains=domains, video_fps=config.video_fps,
        max_video_frames=config.max_video_frames, video=not vcfg.timestamped_video,
    )  # fmt: skip


def check_vision(vision: Any, ids: Sequence[int], prompts: VisionPrompts | None) -> None:
    """A request's `VisionInputs` fits its prompt (and the model takes images at all); on a
    vision model, a prompt without images holds no image or video pad token (its rows would
    have no pixels to stand for: transformers refuses such a prompt too)."""
    if prompts is None:
        raise InvalidRequestError("this model does not take image input", param="messages")
    if vision is None:
        pads = {prompts.config.image_token_id, prompts.config.video_token_id}
        if any(t in pads for t in ids):
            raise InvalidRequestError(
                "the prompt holds image or video pad tokens but no images were given",
                param="prompt",
            )
        return
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
