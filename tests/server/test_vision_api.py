"""Images over HTTP (tiny Qwen2.5-VL, the engine in its own process, as the server runs it):
OpenAI `image_url` parts through the official `openai` SDK and Anthropic `image` blocks through
the official `anthropic` SDK give transformers' greedy tokens; bad images, a disallowed URL
and the limits are 400s naming the problem, with the server answering after.

Owner: tests (server).
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

try:  # newer anthropic SDKs take an httpx2 client
    import httpx2 as anthropic_http  # type: ignore[import-not-found]
except ImportError:
    import httpx as anthropic_http

from metrale.config import EngineConfig
from metrale.engine.engine_process import EngineProcess
from metrale.server.app import create_app
from metrale.server.media import host_allowed
from tests.helpers.vision import IMAGE_PAD, build_qwen25_vl, data_url, hf_greedy, png_bytes

IMAGES = [(40, 28, 1), (23, 61, 2)]
N = 6


@pytest.fixture(scope="module")
def app_and_path() -> Any:
    path = build_qwen25_vl()
    config = EngineConfig(
        model=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
        max_images_per_request=2, max_image_pixels=64 * 64,
    )  # fmt: skip
    handle = EngineProcess(config)
    handle.start()
    try:
        yield create_app(handle), path
    finally:
        handle.shutdown()


def run(app: Any, fn: Any) -> Any:
    async def go() -> Any:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        return await fn(http)

    return asyncio.run(go())


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)


def content(images: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "def f(x):"}]
    for w, h, s in images:
        parts.append({"type": "image_url", "image_url": {"url": data_url(png_bytes(w, h, s))}})
        parts.append({"type": "text", "text": " return"})
    return parts


def test_openai_sdk_images_match_transformers(app_and_path: Any) -> None:
    app, path = app_and_path

    async def calls(http: httpx.AsyncClient) -> list[Any]:
        client = openai_client(http)
        return [
            await client.chat.completions.create(
                model=(await client.models.list()).data[0].id,
                messages=[{"role": "user", "content": content(IMAGES[:n])}],  # type: ignore[misc]
                temperature=0.0,
                max_tokens=N,
                extra_body={"min_tokens": N, "return_token_ids": True},
            )
            for n in range(3)
        ]

    answers = run(app, calls)
    for n, answer in enumerate(answers):
        prompt = answer.model_extra["prompt_token_ids"]
        assert sum(t == IMAGE_PAD for t in prompt) == [0, 20, 44][n]
        tokens = answer.choices[0].model_extra["token_ids"]
        assert tokens == hf_greedy(path, prompt, IMAGES[:n], N), n
        assert answer.usage.prompt_tokens == len(prompt)


def test_anthropic_sdk_image_blocks_match_transformers(app_and_path: Any) -> None:
    app, _path = app_and_path
    w, h, s = IMAGES[1]
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png_bytes(w, h, s)).decode(),
        },
    }

    async def call(http: httpx.AsyncClient) -> Any:
        transport = anthropic_http.ASGITransport(app=app)
        own = anthropic_http.AsyncClient(transport=transport, base_url="http://t")
        client = anthropic.AsyncAnthropic(
            base_url="http://t", api_key="x", http_client=own, max_retries=0
        )
        return await client.messages.create(
            model=(await openai_client(http).models.list()).data[0].id,
            max_tokens=N,
            extra_body={"temperature": 0.0},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "def f(x):"},
                        block,  # type: ignore[list-item]
                        {"type": "text", "text": " return"},
                    ],
                }
            ],
        )

    message = run(app, call)
    ref = openai_reference(app)
    assert message.content[0].text == ref
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 24


def openai_reference(app: Any) -> str:
    """The same one-image prompt over the OpenAI route (greedy, same length)."""

    async def call(http: httpx.AsyncClient) -> Any:
        client = openai_client(http)
        return await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=[{"role": "user", "content": content(IMAGES[1:])}],  # type: ignore[misc]
            temperature=0.0,
            max_tokens=N,
        )

    return run(app, call).choices[0].message.content


def test_bad_images_are_400s_and_the_server_stays_healthy(app_and_path: Any) -> None:
    app, path = app_and_path
    png = png_bytes(40, 28, 1)
    cases = [
        (data_url(png[: len(png) // 2]), "truncated"),
        (data_url(b"GIF89a not really"), "not a decodable image"),
        (data_url(png_bytes(80, 70, 2)), "--max-image-pixels"),
        ("https://example.com/cat.png", "--allowed-media-domains"),
        ("ftp://example.com/cat.png", "data: or http"),
    ]

    async def calls(http: httpx.AsyncClient) -> tuple[list[Any], Any, Any]:
        client = openai_client(http)
        model = (await client.models.list()).data[0].id
        errors = []
        for url, _ in cases:
            parts = [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": parts}],
                    max_tokens=2,  # type: ignore[misc]
                )
            errors.append(err.value)
        three = content([(40, 28, 1)] * 3)
        with pytest.raises(openai.BadRequestError) as many:
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": three}],
                max_tokens=2,  # type: ignore[misc]
            )
        ok = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content(IMAGES[:1])}],  # type: ignore[misc]
            temperature=0.0, max_tokens=N, extra_body={"min_tokens": N, "return_token_ids": True},
        )  # fmt: skip
        return errors, many.value, ok

    errors, many, ok = run(app, calls)
    for err, (_, words) in zip(errors, cases, strict=True):
        assert err.status_code == 400 and words in str(err), (words, str(err))
    assert "--max-images-per-request" in str(many)
    prompt = ok.model_extra["prompt_token_ids"]
    assert ok.choices[0].model_extra["token_ids"] == hf_greedy(path, prompt, IMAGES[:1], N)


def test_allowed_media_domains_match_hosts_and_subdomains() -> None:
    domains = ("example.com",)
    assert host_allowed("https://example.com/a.png", domains)
    assert host_allowed("https://img.example.com/a.png", domains)
    assert not host_allowed("https://example.com.evil.net/a.png", domains)
    assert not host_allowed("https://notexample.com/a.png", domains)
    assert not host_allowed("https://example.com/a.png", ())


def test_text_only_server_refuses_images(tmp_path: Path) -> None:
    from tests.server.helpers import tiny_checkpoint

    config = EngineConfig(model=str(tiny_checkpoint()), device="cpu", num_kv_blocks=16)
    from metrale.engine.async_engine import AsyncEngine
    from metrale.engine.engine import Engine

    handle = AsyncEngine(Engine(config))
    handle.start()
    try:
        app = create_app(handle)

        async def call(http: httpx.AsyncClient) -> Any:
            client = openai_client(http)
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(
                    model=(await client.models.list()).data[0].id,
                    messages=[{"role": "user", "content": content(IMAGES[:1])}],  # type: ignore[misc]
                    max_tokens=2,
                )
            return err.value

        refused = run(app, call)
    finally:
        handle.shutdown()
    assert "does not take image input" in str(refused)


def test_token_counts_include_the_image_tokens(app_and_path: Any) -> None:
    """`/tokenize` and `/v1/messages/count_tokens` count an image as the tokens the chat
    routes prefill for it."""
    app, _ = app_and_path
    w, h, s = IMAGES[0]
    png = png_bytes(w, h, s)
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png).decode(),
        },
    }

    async def calls(http: httpx.AsyncClient) -> tuple[Any, Any, Any]:
        messages = [{"role": "user", "content": content(IMAGES[:1])}]
        tokenized = (await http.post("/tokenize", json={"messages": messages})).json()
        anthropic_body = {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "def f(x):"}, block,
                                                      {"type": "text", "text": " return"}]}],
        }  # fmt: skip
        counted = (await http.post("/v1/messages/count_tokens", json=anthropic_body)).json()
        chat = await openai_client(http).chat.completions.create(
            model=(await openai_client(http).models.list()).data[0].id,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
        return tokenized, counted, chat

    tokenized, counted, chat = run(app, calls)
    prompt = chat.model_extra["prompt_token_ids"]
    assert tokenized["tokens"] == prompt and tokenized["count"] == len(prompt)
    assert counted["input_tokens"] == len(prompt)
    assert sum(t == IMAGE_PAD for t in prompt) == 20
