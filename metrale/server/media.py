"""Images in chat requests on the server: remote URLs fetched only from allowed hosts, then
the engine's `VisionPrompts` (decode with limits, preprocess, pad-token expansion), off the
event loop.

Owner: server. The protocols (`protocol/openai.py`, `protocol/anthropic.py`) keep image parts
as OpenAI-shaped `image_url` parts; the chat routes call `template_messages` before rendering
the template and `vision_inputs` after tokenizing.

Invariants:
- The server fetches nothing unless `--allowed-media-domains` names the URL's host (or a
  parent domain of it); redirects are not followed (a redirect could leave the allowed
  hosts); a fetch reads at most `--max-image-bytes` + 1 bytes within `FETCH_TIMEOUT_S`.
- Every refusal (a text-only model, a disallowed or failing URL, a bad image, a limit) is an
  `InvalidRequestError` (400) naming it; nothing is queued before all images are prepared.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from metrale.engine.vision import VisionPrompts, has_media, split_media
from metrale.errors import InvalidRequestError

FETCH_TIMEOUT_S = 10.0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def host_allowed(url: str, domains: Sequence[str]) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower().strip(".")
    return bool(host) and any(host == d or host.endswith("." + d) for d in domains)


def fetch_image(url: str, vision: VisionPrompts, what: str) -> bytes:
    """The bytes at an http(s) `url` on an allowed host, or a 400 naming why not."""
    if not host_allowed(url, vision.allowed_media_domains):
        host = urllib.parse.urlsplit(url).hostname or "?"
        raise InvalidRequestError(
            f"{what}: the server does not fetch images from '{host}' (allowed with "
            "--allowed-media-domains); send the image as a data: URL",
            param="messages",
        )
    limit = vision.limits.image.max_bytes
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"{what}: fetching {url} failed ({exc})", param="messages"
        ) from exc
    if len(data) > limit:
        raise InvalidRequestError(
            f"{what}: the image at {url} is over the limit of {limit} bytes per image "
            "(--max-image-bytes)",
            param="messages",
        )
    return data


def _fetch_remote(messages: list[dict[str, Any]], vision: VisionPrompts) -> list[dict[str, Any]]:
    """`messages` with every http(s) `image_url` part's URL replaced by the fetched bytes."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = "video" if isinstance(part, dict) and "video_url" in part else "image"
            holder = part.get(f"{kind}_url") if isinstance(part, dict) else None
            url = holder.get("url") if isinstance(holder, dict) else None
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                data = fetch_image(url, vision, f"messages[{i}].content[{j}]")
                part = {"type": kind, kind: data}
            elif isinstance(url, str) and not url.startswith("data:"):
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}]: {kind} URLs must be data: or http(s) URLs",
                    param="messages",
                )
            parts.append(part)
        out.append({**message, "content": parts})
    return out


async def template_messages(
    vision: VisionPrompts | None, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[Any]]:
    """`(messages for the chat template, the images' bytes in order)`; no images: as given."""
    if not has_media(messages):
        return messages, []
    if vision is None:
        where = next(
            f"messages[{i}].content[{j}]"
            for i, m in enumerate(messages)
            if isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"])
            if isinstance(p, dict) and p.get("type") != "text"
        )
        raise InvalidRequestError(f"{where}: this model does not take image input", param=where)
    fetched = await asyncio.to_thread(_fetch_remote, messages, vision)
    return split_media(fetched)


async def vision_inputs(
    vision: VisionPrompts | None, ids: list[int], images: list[Any]
) -> tuple[list[int], Any]:
    """`(expanded prompt ids, VisionInputs)` for a tokenized prompt with images (decoding
    and preprocessing run on a worker thread); without images: `(ids, None)`."""
    if not images:
        return ids, None
    assert vision is not None
    return await asyncio.to_thread(vision.build, ids, images)
