"""Issue 17, vLLM's extension fields on `/v1/completions` and `/v1/chat/completions`:
`allowed_token_ids`, `bad_words`, `prompt_logprobs`, `return_token_ids`,
`return_tokens_as_token_ids`, `truncate_prompt_tokens`, `add_special_tokens`, and for chat
`echo`, `continue_final_message` and a per-request `chat_template`. Each is checked against
what it means (the same tokens from the reference `LLM`, or the property it promises).

In-process: the app over httpx's ASGI transport, on one `AsyncEngine`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metrale import LLM, SamplingParams
from metrale.engine.async_engine import AsyncEngine
from metrale.server.app import create_app
from tests.server.helpers import running_engine

PROMPT = "def fibonacci(n):\n    "
USER = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[AsyncEngine]:
    with running_engine(checkpoint, num_kv_blocks=128, enable_prefix_caching=False) as handle:
        yield handle


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return create_app(engine)


def post(app: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json=body, timeout=60)

    reply = asyncio.run(go())
    assert reply.status_code == 200, reply.text
    if body.get("stream"):
        return {"frames": [json.loads(line[6:]) for line in reply.text.splitlines()
                           if line.startswith("data: {")]}  # fmt: skip
    return reply.json()  # type: ignore[no-any-return]


def greedy(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}


def test_allowed_token_ids_and_bad_words(app: Any, engine: AsyncEngine, reference: LLM) -> None:
    base = post(app, "/v1/completions", greedy(return_token_ids=True))["choices"][0]
    allowed = sorted(set(base["token_ids"][1:4]) | {5, 6, 7})
    only = post(app, "/v1/completions", greedy(allowed_token_ids=allowed, return_token_ids=True))
    got = only["choices"][0]["token_ids"]
    assert set(got) <= set(allowed), got
    ref = reference.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
    )[0].outputs[0]
    assert got == ref.token_ids

    # A word the model writes, banned: the output no longer holds it.
    tokenizer = engine.tokenizer
    out = base["token_ids"]

    def spelled(seq: list[int]) -> str | None:
        word = tokenizer.decode(seq).lstrip()
        forms = (tokenizer.encode(word, False), tokenizer.encode(" " + word, False))
        return word if word and seq in forms else None

    # A two-token word of the output if one re-tokenizes to itself, else a one-token word.
    candidates = [out[k : k + 2] for k in range(1, len(out) - 1)] + [[t] for t in out[1:]]
    word = next(w for w in map(spelled, candidates) if w is not None)
    banned = post(app, "/v1/completions", greedy(bad_words=[word], return_token_ids=True))
    ids = banned["choices"][0]["token_ids"]
    for seq in ([*tokenizer.encode(word, False)], [*tokenizer.encode(" " + word, False)]):
        windows = [ids[i : i + len(seq)] for i in range(len(ids) - len(seq) + 1)]
        assert seq not in windows, (word, seq, ids)
    assert ids != base["token_ids"]


def test_prompt_logprobs_and_token_ids(app: Any, engine: AsyncEngine, reference: LLM) -> None:
    body = post(app, "/v1/completions", greedy(prompt_logprobs=2, return_token_ids=True))
    choice = body["choices"][0]
    prompt_ids = engine.tokenizer.encode(PROMPT)
    assert choice["prompt_token_ids"] == prompt_ids
    assert engine.tokenizer.decode(choice["token_ids"]) == choice["text"]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) and scored[0] is None
    ref = reference.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    )[0].prompt_logprobs
    assert ref is not None
    for token, position, expected in zip(prompt_ids[1:], scored[1:], ref[1:]):
        assert str(token) in position
        assert expected is not None
        assert position[str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-5)
        assert len(position) <= 3  # the top 2 and the prompt's own token

    # Streamed token ids add up to the blocking answer's.
    frames = post(app, "/v1/completions", greedy(return_token_ids=True, stream=True))["frames"]
    streamed = [t for f in frames for c in f["choices"] for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]
    assert frames[0]["choices"][0]["prompt_token_ids"] == prompt_ids

    as_ids = post(app, "/v1/completions", greedy(logprobs=1, return_tokens_as_token_ids=True))
    tokens = as_ids["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]


def test_truncate_prompt_tokens_and_add_special_tokens(app: Any, engine: AsyncEngine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    cut = post(app, "/v1/completions", greedy(truncate_prompt_tokens=4, return_token_ids=True))
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["prompt_token_ids"] == ids[-4:]
    same = post(app, "/v1/completions", {**greedy(), "prompt": ids[-4:]})
    assert cut["choices"][0]["text"] == same["choices"][0]["text"]
    plain = post(app, "/v1/completions", greedy(add_special_tokens=False, max_tokens=1))
    assert plain["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT, False))


def test_chat_echo_continue_final_message_and_template(app: Any, engine: AsyncEngine) -> None:
    head = "def add(a, b):"
    convo = [*USER, {"role": "assistant", "content": head}]
    body = {"messages": convo, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True, "max_tokens": 8, "temperature": 0, "return_token_ids": True}  # fmt: skip
    chat = post(app, "/v1/chat/completions", body)
    message = chat["choices"][0]["message"]["content"]
    assert message.startswith(head)
    # The same tokens as the rendered prompt sent to completions.
    prompt_ids = chat["prompt_token_ids"]
    assert engine.tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith(head)
    raw = post(app, "/v1/completions", {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0})
    assert message == head + raw["choices"][0]["text"]

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    custom = post(
        app,
        "/v1/chat/completions",
        {"messages": USER, "chat_template": template, "max_tokens": 1, "return_token_ids": True},
    )
    assert custom["prompt_token_ids"] == engine.tokenizer.encode(USER[0]["content"], False)


def test_priority_needs_the_priority_policy(app: Any) -> None:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions", json=greedy(priority=3), timeout=60)

    reply = asyncio.run(go())
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "priority"
    assert post(app, "/v1/completions", greedy(priority=0))["choices"]
