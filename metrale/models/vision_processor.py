"""Image decoding with limits, and the Qwen-VL image processor: resize to the patch grid,
rescale and normalise, patchify.

Owner: models (the processor belongs to the checkpoint: `preprocessor_config.json` gives its
sizes, mean and std). An exact re-implementation of transformers' PIL-backend
`Qwen2VLImageProcessor` (transformers' torch backend needs torchvision, which is not a
dependency): the same `smart_resize` rule, PIL bicubic resampling of the 8-bit RGB image,
`x * (1/255)` in float64 cast to float32, `(x - mean) / std` in float32, and the
merge-block-major patch order with the image repeated `temporal_patch_size` times.

Invariants:
- `decode_image` never decodes pixels before checking the header's size against the limits;
  a byte string that is not an image, a truncated one, or one over a limit is an
  `InvalidRequestError` naming what is wrong (and the limit, with the flag that sets it).
- `process` returns float32 `[grid_h * grid_w, C * T * p * p]` and `(1, grid_h, grid_w)`;
  both grid sides are multiples of `merge_size` and the area stays within
  `[min_pixels, max_pixels]` (never below one merge block).
- No EXIF rotation is applied (transformers' processor applies none either).
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metrale.errors import CheckpointError, InvalidRequestError

#: CLIP's normalisation, the Qwen-VL processors' default.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageLimits:
    """Per-image limits checked before decoding pixels."""

    #: Encoded size of one image.
    max_bytes: int = 20 * 2**20
    #: Decoded width x height of one image.
    max_pixels: int = 4096 * 4096


def decode_image(
    data: bytes, limits: ImageLimits, what: str = "image", keep_open: bool = False
) -> Any:
    """`data` decoded into an RGB `PIL.Image`, or `InvalidRequestError` naming the problem;
    `keep_open`: the opened image as it is (an animation's frames stay readable)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # an install without the server extra
        raise InvalidRequestError(
            "image input needs Pillow, which is not installed (pip install 'metrale[server]')"
        ) from exc

    if len(data) > limits.max_bytes:
        raise InvalidRequestError(
            f"{what} is {len(data)} bytes, over the limit of {limits.max_bytes} bytes per image "
            "(--max-image-bytes)",
            param="messages",
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limits.max_pixels:
                raise InvalidRequestError(
                    f"{what} is {width}x{height} = {width * height} pixels, over the limit of "
                    f"{limits.max_pixels} pixels per image (--max-image-pixels)",
                    param="messages",
                )
            image.load()
    except InvalidRequestError:
        raise
    except UnidentifiedImageError as exc:
        raise InvalidRequestError(
            f"{what} is not a decodable image (PNG, JPEG, GIF, WebP, BMP, ...)", param="messages"
        ) from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(
            f"{what} cannot be decoded: {exc} (truncated or corrupt)", param="messages"
        ) from exc
    if width < 1 or height < 1:
        raise InvalidRequestError(f"{what} has no pixels ({width}x{height})", param="messages")
    if keep_open:
        return image
    return image if image.mode == "RGB" else image.convert("RGB")


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The Qwen-VL target size: both sides multiples of `factor`, the aspect ratio kept as
    closely as rounding allows, the area within `[min_pixels, max_pixels]`."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError(
            f"image aspect ratio {max(height, width) / min(height, width):.0f} is over 200",
            param="messages",
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class QwenVLImageProcessor:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, **overrides: Any) -> QwenVLImageProcessor:
        """From `preprocessor_config.json` (transformers' defaults where absent);
        `overrides` (e.g. a server's `max_pixels`) win."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw: dict[str, Any] = {}
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
        size = raw.get("size") or {}
        fields: dict[str, Any] = {}
        for key in ("patch_size", "merge_size", "temporal_patch_size"):
            if key in raw:
                fields[key] = int(raw[key])
        lo = raw.get("min_pixels", size.get("shortest_edge"))
        hi = raw.get("max_pixels", size.get("longest_edge"))
        if lo is not None:
            fields["min_pixels"] = int(lo)
        if hi is not None:
            fields["max_pixels"] = int(hi)
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                fields[key] = tuple(float(v) for v in raw[key])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Decoder tokens one image of this size becomes."""
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def normalized(self, image: Any) -> np.ndarray:
        """The resized, rescaled and normalised image, float32 `[C, H, W]`."""
        from PIL import Image

        h, w = self.target_size(image.height, image.width)
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
        pixels = (np.asarray(image, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(
            np.float32
        )
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        return np.ascontiguousarray(((pixels - mean) / std).transpose(2, 0, 1))

    def process(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One RGB image -> `(patches [P, C*T*p*p] float32, (1, grid_h, grid_w))`."""
        return self.patchify(self.normalized(image)[None].repeat(self.temporal_patch_size, 0))

    def process_frames(self, frames: list[Any]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Video frames (one size, taken from the first) -> patches and `(t, gh, gw)`:
        consecutive frames pair up along time (the last frame repeats to fill the pair)."""
        if not frames:
            raise InvalidRequestError("a video needs at least one frame", param="messages")
        size = (frames[0].width, frames[0].height)
        stack = [
            self.normalized(f if (f.width, f.height) == size else f.resize(size)) for f in frames
        ]
        while len(stack) % self.temporal_patch_size:
            stack.append(stack[-1])
        return self.patchify(np.stack(stack))

    def patchify(self, video: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """float32 `[F, C, H, W]` (F a multiple of `temporal_patch_size`) -> patches in the
        merge-block-major order and the `(t, gh, gw)` grid."""
        frames, channels, height, width = video.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gt, gh, gw = frames // tp, height // p, width // p
        x = video.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
        # -> (t, gh/m, gw/m, m, m, C, tp, p, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x.reshape(gt * gh * gw, channels * tp * p * p)), (gt, gh, gw)
