"""Issue 17, the routes and flags around generation: `/tokenize`, `/detokenize`, `/version`,
`/v1/messages/count_tokens`, `/docs`; the request-field policy (unknown fields ignored with a
warning and a count, or refused under `--strict-request-fields`); several served model names;
`--max-logprobs`; vLLM's serve flags; `python -m metrale`.

In-process: the app over httpx's ASGI transport, on one `AsyncEngine`."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import metrale
from metrale.cli import build_parser
from metrale.engine.async_engine import AsyncEngine
from metrale.errors import InvalidRequestError
from metrale.server.app import create_app
from metrale.server.launch import _check_vllm_compat_flags
from tests.server.helpers import running_engine

USER = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[AsyncEngine]:
    with running_engine(checkpoint, num_kv_blocks=128, enable_prefix_caching=False) as handle:
        yield handle


def call(app: Any, method: str, path: str, body: Any = None, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, json=body, headers=headers, timeout=30)

    return asyncio.run(go())


def counter(app: Any, name: str, **labels: str) -> float:
    text = app.state.metrale.metrics.exposition().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_tokenize_and_detokenize(engine: AsyncEngine) -> None:
    app = create_app(engine)
    tokenizer = engine.tokenizer
    text = "def add(a, b):\n    return a + b"
    reply = call(app, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.info.max_model_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert call(app, "POST", "/tokenize", {"prompt": text}).json()["token_strs"] is None
    plain = call(app, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = call(app, "POST", "/detokenize", {"tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    with_bos = call(app, "POST", "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert with_bos == tokenizer.decode(body["tokens"], skip_special_tokens=False)

    # The chat shape counts what /v1/chat/completions prefills.
    chat = call(app, "POST", "/tokenize", {"messages": USER})
    completion = call(app, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 1})
    assert chat.json()["count"] == completion.json()["usage"]["prompt_tokens"]
    assert chat.json()["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(USER, add_generation_prompt=True), add_special_tokens=False
    )

    for path, bad, param in (
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ):
        reply = call(app, "POST", path, bad)
        assert reply.status_code in (400, 404), reply.text
        assert reply.json()["error"]["param"] == param, reply.text


def test_continue_final_message_ends_on_the_assistant_text(engine: AsyncEngine) -> None:
    app = create_app(engine)
    convo = [*USER, {"role": "assistant", "content": "def add(a, b):"}]
    body = {"messages": convo, "add_generation_prompt": False, "continue_final_message": True}
    reply = call(app, "POST", "/tokenize", body)
    assert reply.status_code == 200, reply.text
    text = engine.tokenizer.decode(reply.json()["tokens"], skip_special_tokens=False)
    assert text.endswith("def add(a, b):"), text
    both = {**body, "add_generation_prompt": True}
    assert call(app, "POST", "/tokenize", both).status_code == 400
    user_last = {**body, "messages": USER}
    assert call(app, "POST", "/tokenize", user_last).json()["error"]["param"] == "messages"


def test_count_tokens_matches_messages_usage(engine: AsyncEngine) -> None:
    app = create_app(engine)
    body = {"system": "You write Python.", "messages": USER}
    count = call(app, "POST", "/v1/messages/count_tokens", body)
    assert count.status_code == 200, count.text
    message = call(app, "POST", "/v1/messages", {**body, "max_tokens": 1}).json()
    used = message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"]
    assert count.json() == {"input_tokens": used}
    # The SDK's own call.
    import anthropic

    try:  # newer SDKs take an httpx2 client
        import httpx2 as http_lib  # type: ignore[import-not-found]
    except ImportError:
        http_lib = httpx

    async def sdk() -> int:
        http = http_lib.AsyncClient(transport=http_lib.ASGITransport(app=app), base_url="http://t")
        client = anthropic.AsyncAnthropic(
            base_url="http://t", api_key="x", http_client=http, max_retries=0
        )
        result = await client.messages.count_tokens(
            model=engine.info.served_model_name,
            **body,  # type: ignore[arg-type]
        )
        return result.input_tokens

    assert asyncio.run(sdk()) == used


def test_version_and_docs_are_open_and_tokenize_needs_the_key(engine: AsyncEngine) -> None:
    app = create_app(engine, api_key="secret")
    assert call(app, "GET", "/version").json() == {"version": metrale.__version__}
    docs = call(app, "GET", "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert call(app, "POST", "/tokenize", {"prompt": "x"}).status_code == 401
    keyed = call(app, "POST", "/tokenize", {"prompt": "x"}, authorization="Bearer secret")
    assert keyed.status_code == 200
    paths = call(app, "GET", "/openapi.json").json()["paths"]
    for path in ("/tokenize", "/detokenize", "/version", "/v1/messages/count_tokens"):
        assert path in paths, sorted(paths)


def test_unknown_fields_are_ignored_and_counted_or_refused_when_strict(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    lenient = create_app(engine)
    body = {"prompt": "def f", "max_tokens": 2, "bogus_field": 1, "other_unknown": [1]}
    caplog.set_level(logging.WARNING)
    reply = call(lenient, "POST", "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert counter(lenient, "metrale_ignored_request_fields_total", endpoint="/v1/completions") == 2
    assert any("bogus_field" in r.getMessage() for r in caplog.records)
    strict = create_app(engine, strict_request_fields=True)
    refused = call(strict, "POST", "/v1/completions", body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "bogus_field"
    # Fields that would change the result and are not built are refused in either mode.
    assert (
        call(lenient, "POST", "/v1/completions", {"prompt": "x", "best_of": 3}).status_code == 400
    )


def test_several_served_names_and_max_logprobs(engine: AsyncEngine) -> None:
    app = create_app(engine, served_model_name=["first", "second"], max_logprobs=2)
    models = call(app, "GET", "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["first", "second"]
    assert call(app, "GET", "/v1/models/second").status_code == 200
    reply = call(
        app, "POST", "/v1/completions", {"model": "second", "prompt": "x", "max_tokens": 1}
    )
    assert reply.status_code == 200 and reply.json()["model"] == "first"
    assert (
        call(app, "POST", "/v1/completions", {"model": "third", "prompt": "x"}).status_code == 404
    )
    too_many = {"prompt": "x", "max_tokens": 1, "logprobs": 3}
    refused = call(app, "POST", "/v1/completions", too_many)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert call(app, "POST", "/v1/completions", {**too_many, "logprobs": 2}).status_code == 200


def test_vllm_serve_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "m", "--served-model-name", "a", "b", "--trust-remote-code",
         "--disable-log-requests", "--enable-chunked-prefill", "-tp", "1",
         "--uvicorn-log-level", "info", "--max-logprobs", "5", "--strict-request-fields"]
    )  # fmt: skip
    _check_vllm_compat_flags(args)
    from metrale.engine_flags import engine_config_from_args, served_model_names

    assert served_model_names(args) == ["a", "b"]
    assert engine_config_from_args(args).served_model_name == "a"
    tp2 = parser.parse_args(["serve", "m", "-tp", "2"])
    assert engine_config_from_args(tp2).tensor_parallel_size == 2
    for bad, param in (
        (["--no-enable-chunked-prefill"], "enable_chunked_prefill"),
        (["--max-logprobs", "1000"], "max_logprobs"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            _check_vllm_compat_flags(parser.parse_args(["serve", "m", *bad]))
        assert err.value.param == param


def test_python_dash_m_metrale() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "metrale", "serve", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "--tensor-parallel-size" in done.stdout and "--strict-request-fields" in done.stdout


def test_serve_freezes_its_start_up_objects() -> None:
    """`metrale serve` moves its start-up objects out of the collector's reach (a full
    collection over them paused the HTTP process for ~106 ms on the CPU machine)."""
    import gc

    from metrale.server.launch import _freeze_startup_objects

    try:
        _freeze_startup_objects()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
