"""Every error class of `metrale serve` answers with its status and an OpenAI-shaped body, and
never disturbs another request: 401 (missing / wrong key, key from METRALE_API_KEY), 400 for
invalid bodies and values (naming the param) and unsupported fields, 404 for an unknown model
or route, 400 `context_length_exceeded`, 413 for an oversized body, 503 + Retry-After when the
queue is full."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import anthropic
import httpx
import openai
import pytest

from tests.server.helpers import (
    SERVED_NAME,
    ServerProcess,
    assert_openai_error,
    metric,
    scrape,
    sse_json,
)

KEY = "sk-test-metrale"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--num-kv-blocks", "96", "--max-num-seqs", "1", "--max-queue", "1",
        env={"METRALE_API_KEY": KEY},
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", AUTH)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kwargs)


# -------------------------------------------------------------------------- auth


def test_missing_and_wrong_keys_get_401(server: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    missing = assert_openai_error(post(server, "/v1/completions", body, headers={}), 401)
    assert missing["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(post(server, "/v1/completions", body, headers=wrong), 401)
    assert_openai_error(httpx.get(server.url + "/v1/models"), 401)
    assert post(server, "/v1/completions", body, headers={"x-api-key": KEY}).status_code == 200
    assert post(server, "/v1/completions", body).status_code == 200
    # Probes stay open.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    # The SDKs see their own authentication errors.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == SERVED_NAME
    bad_claude = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_claude.messages.create(
            model=SERVED_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    msg = claude.messages.create(
        model=SERVED_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.usage.output_tokens >= 1


# ------------------------------------------------------------------- bad bodies

USER = [{"role": "user", "content": "hi"}]

INVALID = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": [[1, 2], "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools[0]"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), INVALID, ids=lambda v: str(v)[:40])
def test_invalid_body_is_400_naming_the_param(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    assert_openai_error(post(server, path, body), 400, param)


ANTHROPIC_INVALID = [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f g", "input_schema": {}}]}, "tools[0]"),
    ({"max_tokens": 4, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": "Sure"}]}, "messages[1]"),
    ({"max_tokens": 4, "messages": USER, "stream": "yes please"}, "stream"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), ANTHROPIC_INVALID, ids=lambda v: str(v)[:40])
def test_invalid_messages_body(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    response = post(server, "/v1/messages", body)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["param"] == param


def test_malformed_json(server: ServerProcess) -> None:
    for raw in (b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"):
        response = httpx.post(
            server.url + "/v1/chat/completions",
            content=raw,
            headers={**AUTH, "content-type": "application/json"},
        )
        assert_openai_error(response, 400)


def test_unknown_model_and_routes_are_404(server: ServerProcess) -> None:
    for path, body in (
        ("/v1/completions", {"model": "gpt-17", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "gpt-17", "messages": USER}),
    ):
        error = assert_openai_error(post(server, path, body), 404, "model")
        assert error["code"] == "model_not_found"
    response = post(
        server, "/v1/messages", {"model": "claude-0", "max_tokens": 2, "messages": USER}
    )
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
    assert_openai_error(httpx.get(server.url + "/v1/models/gpt-17", headers=AUTH), 404, "model")
    assert_openai_error(httpx.get(server.url + "/v1/nothing-here", headers=AUTH), 404)
    assert_openai_error(httpx.get(server.url + "/v1/completions", headers=AUTH), 405)


def test_prompt_over_the_context(server: ServerProcess) -> None:
    long_ids = [(i * 37) % 500 + 6 for i in range(600)]  # max_model_len is 512
    error = assert_openai_error(
        post(server, "/v1/completions", {"prompt": long_ids}), 400, "prompt"
    )
    assert error["code"] == "context_length_exceeded"
    too_many = {"prompt": long_ids[:100], "max_tokens": 500}
    error = assert_openai_error(post(server, "/v1/completions", too_many), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    chat = {"messages": [{"role": "user", "content": "word " * 700}], "max_tokens": 4}
    error = assert_openai_error(post(server, "/v1/chat/completions", chat), 400, "messages")
    assert error["code"] == "context_length_exceeded"


def test_oversized_body_is_413(server: ServerProcess) -> None:
    address = urlparse(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {64 * 2**20}\r\n\r\n".encode()
        )
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    reply = data.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert '"error"' in reply and '"invalid_request_error"' in reply


# ----------------------------------------------------------- overload, isolation


def test_full_queue_is_503_with_retry_after(server: ServerProcess) -> None:
    """max_num_seqs=1, max_queue=1: one request runs, one waits, the next is refused.

    The running request is a 400-token stream of the tiny checkpoint, which can end before
    the third request arrives (a fast step, a loaded machine): an attempt whose third request
    is served is tried again, five at most; a server that never refuses fails them all."""
    for _ in range(5):
        outcome = _full_queue_attempt(server)
        if outcome != "raced":
            break
    assert outcome == "refused", "the running request ended before the queue could be filled"


def _full_queue_attempt(server: ServerProcess) -> str:
    """One try: "refused" (the 503 checked), or "raced" (the third request was served, or the
    second never had to wait). The running stream is not read past its first line: a
    client that does not read holds the stream back, which keeps the request running."""
    long_body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=long_body, headers=AUTH, timeout=60
    ) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # (dropping this iterator would close the stream)
        next(lines)  # it is running now
        waiting_result: dict[str, Any] = {}

        def wait_in_queue() -> None:
            waiting_result["response"] = post(
                server, "/v1/completions", {"prompt": "y", "max_tokens": 2}
            )

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        deadline = time.monotonic() + 10
        while metric(scrape(server.url), "metrale_num_requests_waiting") < 1:
            if time.monotonic() > deadline or "response" in waiting_result:
                waiter.join(30)
                return "raced"  # the second request ran at once: the first had ended
            time.sleep(0.02)
        refused = post(server, "/v1/completions", {"prompt": "z", "max_tokens": 2})
        if refused.status_code == 200:  # the running request ended first (or no refusal)
            waiter.join(30)
            return "raced"
        error = assert_openai_error(refused, 503)
        assert refused.headers["retry-after"].isdigit()
        assert error["type"] == "server_overloaded"
    # Closing the running stream aborted it, so the queued request now completes.
    waiter.join(30)
    assert waiter_ok(waiting_result)
    return "refused"


def waiter_ok(result: dict[str, Any]) -> bool:
    response = result.get("response")
    return response is not None and response.status_code == 200


def test_bad_requests_do_not_disturb_a_running_stream(server: ServerProcess) -> None:
    body = {"prompt": "import os\n", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    expected = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH
    ) as r:
        lines = r.iter_lines()
        first = [next(lines), next(lines)]
        for bad in (b"{", b'{"prompt": 5}', b'{"messages": 1}'):
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
                reply = httpx.post(server.url + path, content=bad, headers=AUTH)
                assert 400 <= reply.status_code < 500
        frames = sse_json([*first, *lines])
    assert frames[-1] == "[DONE]"
    text = "".join(f["choices"][0]["text"] for f in frames if isinstance(f, dict) and f["choices"])
    assert text == expected
    assert httpx.get(server.url + "/health").status_code == 200
