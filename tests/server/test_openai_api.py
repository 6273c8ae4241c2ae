"""`metrale serve` driven by the official `openai` and `anthropic` SDKs and raw HTTP: the same
tokens as `LLM.generate` / `LLM.chat`, streamed deltas that concatenate to the blocking text,
seeded `n` reproducible, stop strings cut exactly, echo + logprobs equal to the engine's prompt
logprobs, `cached_tokens` everywhere (and > 0 on a repeated long prompt), metrics that parse
and move with traffic."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from metrale import LLM, SamplingParams
from tests.server.helpers import (
    SERVED_NAME,
    ServerProcess,
    metric,
    scrape,
    sse_events,
    sse_json,
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a function that adds two numbers."},
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--num-kv-blocks", "256", "--max-num-seqs", "16")
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def ref_text(llm: LLM, prompt: Any, **params: Any) -> list[str]:
    out = llm.generate([prompt], SamplingParams(**params))[0]
    return [c.text for c in out.outputs]


def assert_usage(usage: Any, prompt_tokens: int | None = None) -> None:
    assert usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert isinstance(usage.prompt_tokens_details.cached_tokens, int)
    if prompt_tokens is not None:
        assert usage.prompt_tokens == prompt_tokens


# ----------------------------------------------------------------------- basics


def test_health_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME
    card = models[0].model_extra or {}  # the stored dtypes, said plainly
    assert card["weight_dtype"] == card["kv_cache_dtype"] == card["dtype"] == "float32"


def test_completion_same_tokens_as_llm(client: openai.OpenAI, reference: LLM) -> None:
    prompt = "def add(a, b):"
    ids = reference.get_tokenizer().encode(prompt)
    greedy = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=16, temperature=0
    )
    assert [c.text for c in greedy.choices] == ref_text(
        reference, prompt, max_tokens=16, temperature=0
    )
    assert greedy.choices[0].finish_reason == "length"
    assert_usage(greedy.usage, prompt_tokens=len(ids))
    assert greedy.usage.completion_tokens == 16
    # A seeded, sampled request: token ids as the prompt this time.
    sampled = client.completions.create(
        model=SERVED_NAME, prompt=ids, max_tokens=16, temperature=0.9, top_p=0.95, seed=11
    )
    assert [c.text for c in sampled.choices] == ref_text(
        reference, ids, max_tokens=16, temperature=0.9, top_p=0.95, seed=11
    )


def test_completion_stream_concatenates_to_blocking_text(
    client: openai.OpenAI, reference: LLM
) -> None:
    kwargs: dict[str, Any] = dict(
        model=SERVED_NAME, prompt="class Foo:", max_tokens=20, temperature=0.7, seed=3
    )
    blocking = client.completions.create(**kwargs)
    assert [c.text for c in blocking.choices] == ref_text(
        reference, "class Foo:", max_tokens=20, temperature=0.7, seed=3
    )
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == blocking.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert_usage(chunks[-1].usage, prompt_tokens=blocking.usage.prompt_tokens)
    assert chunks[-1].usage.completion_tokens == 20
    # Without include_usage the last choice chunk carries the usage.
    plain = list(client.completions.create(**kwargs, stream=True))
    assert plain[-1].choices and plain[-1].choices[0].finish_reason == "length"
    assert_usage(plain[-1].usage)


def test_multiple_prompts_and_n(client: openai.OpenAI, reference: LLM) -> None:
    prompts = ["import os\n", "for i in range(3):"]
    res = client.completions.create(
        model=SERVED_NAME, prompt=prompts, n=2, max_tokens=8, temperature=1.0, seed=5
    )
    assert [c.index for c in sorted(res.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in res.choices}
    for p, prompt in enumerate(prompts):
        expected = ref_text(reference, prompt, n=2, max_tokens=8, temperature=1.0, seed=5)
        assert [by_index[p * 2], by_index[p * 2 + 1]] == expected
    tok = reference.get_tokenizer()
    assert res.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert res.usage.completion_tokens == 4 * 8


def test_chat_same_tokens_as_llm_chat(client: openai.OpenAI, reference: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    expected = reference.chat(CHAT, params)[0]
    res = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=16, temperature=0
    )
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected.outputs[0].text
    assert res.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert_usage(res.usage, prompt_tokens=len(expected.prompt_token_ids))
    # Same with max_completion_tokens, text content parts, and streaming.
    parts = [
        CHAT[0],
        {"role": "user", "content": [{"type": "text", "text": CHAT[1]["content"]}]},
    ]
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=parts,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == res.choices[
        0
    ].finish_reason
    assert chunks[-1].choices == []
    assert_usage(chunks[-1].usage, prompt_tokens=len(expected.prompt_token_ids))
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens


def test_chat_seeded_n3_reproducible(client: openai.OpenAI, reference: LLM) -> None:
    kwargs: dict[str, Any] = dict(
        model=SERVED_NAME, messages=CHAT, n=3, max_tokens=10, temperature=1.0, seed=1234
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "the three choices of a seeded request should differ"
    expected = reference.chat(CHAT, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=1234))
    assert texts == [c.text for c in expected[0].outputs]
    # Streaming n=3 gives the same three texts.
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


# ------------------------------------------------------------------- stop strings


def _spanning_stop(llm: LLM, prompt: str, max_tokens: int) -> tuple[str, str]:
    """A stop string that straddles a token boundary of the greedy output, and the text
    expected before it (its first occurrence is at that boundary)."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    tok = llm.get_tokenizer()
    ids, text = out.outputs[0].token_ids, out.outputs[0].text
    bounds = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    for k in range(2, len(ids) - 1):
        cut = bounds[k]
        if bounds[k - 1] >= cut - 1 or bounds[k + 1] <= cut + 1 or cut < 3:
            continue
        stop = text[cut - 2 : cut + 2]
        if "\ufffd" in stop or not stop.isprintable() or text.find(stop) != cut - 2:
            continue
        return stop, text[: cut - 2]
    raise AssertionError(f"no usable token boundary in {text!r}")


def test_stop_string_spanning_tokens(
    client: openai.OpenAI, claude: anthropic.Anthropic, reference: LLM
) -> None:
    prompt = "import os\nimport sys\n"
    stop, before = _spanning_stop(reference, prompt, 24)
    res = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\u2603zz"]
    )
    assert res.choices[0].text == before
    assert res.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
        )
        if c.choices
    )
    assert streamed == before


def test_chat_and_messages_stop_sequences(
    client: openai.OpenAI, claude: anthropic.Anthropic, reference: LLM
) -> None:
    full = reference.chat(CHAT[1:], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    text = full.text
    # A stop string from the middle of the output (first occurrence), possibly across tokens.
    stop = next(
        text[i : i + 3]
        for i in range(2, len(text) - 3)
        if "\ufffd" not in text[i : i + 3]
        and text[i : i + 3].isprintable()
        and text.find(text[i : i + 3]) == i
    )
    before = text[: text.find(stop)]
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT[1:], max_tokens=24, temperature=0, stop=stop
    )
    assert chat.choices[0].message.content == before
    assert chat.choices[0].finish_reason == "stop"
    msg = claude.messages.create(
        model=SERVED_NAME,
        messages=CHAT[1:],
        max_tokens=24,
        stop_sequences=[stop],
        extra_body={"temperature": 0},
    )
    assert msg.content[0].text == before
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == stop


# ----------------------------------------------------------------------- logprobs


def test_echo_logprobs_equal_engine_prompt_logprobs(client: openai.OpenAI, reference: LLM) -> None:
    tok = reference.get_tokenizer()
    ids = tok.encode("def fib(n):\n    if n < 2:\n        return n\n")
    ref = reference.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=1))[0]
    res = client.completions.create(
        model=SERVED_NAME, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_lps = lp.token_logprobs[: len(ids)]
    assert ref.prompt_logprobs is not None
    for pos in range(1, len(ids)):
        expected = ref.prompt_logprobs[pos][ids[pos]].logprob
        assert math.isclose(prompt_lps[pos], expected, abs_tol=1e-4), pos
    assert res.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=False))
    assert lp.text_offset == sorted(lp.text_offset)
    # max_tokens=0 with echo scores the prompt only (the lm-evaluation-harness path).
    only = client.completions.create(
        model=SERVED_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0
    )
    assert only.usage.completion_tokens == 0
    assert len(only.choices[0].logprobs.token_logprobs) == len(ids)
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(prompt_lps[1:], abs=1e-4)
    # Streaming echo: the first chunk is the prompt with its logprobs.
    chunks = list(
        client.completions.create(
            model=SERVED_NAME, prompt=ids, max_tokens=3, echo=True, logprobs=1, stream=True
        )
    )
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1 : len(ids)] == pytest.approx(prompt_lps[1:], abs=1e-4)
    total = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices)
    assert total == len(ids) + 3


def test_completion_logprobs_match_engine(client: openai.OpenAI, reference: LLM) -> None:
    prompt = "class Foo:"
    ref = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    res = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    lp = res.choices[0].logprobs
    choice = ref.outputs[0]
    assert len(lp.tokens) == len(choice.token_ids) == 8
    assert choice.logprobs is not None
    for i, (token, position) in enumerate(zip(choice.token_ids, choice.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(position[token].logprob, abs=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4 or len(set(lp.top_logprobs[i])) < 3


def test_chat_logprobs(client: openai.OpenAI, reference: LLM) -> None:
    ref = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    res = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = res.choices[0].logprobs.content
    choice = ref.outputs[0]
    assert len(content) == len(choice.token_ids) == res.usage.completion_tokens
    assert choice.logprobs is not None
    for entry, token, position in zip(content, choice.token_ids, choice.logprobs):
        assert entry.logprob == pytest.approx(position[token].logprob, abs=1e-4)
        assert isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert entry.logprob <= top[0] + 1e-6
    streamed = []
    for chunk in client.chat.completions.create(
        model=SERVED_NAME,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_extra_sampling_fields(client: openai.OpenAI, reference: LLM) -> None:
    extra = dict(
        top_k=5, min_p=0.01, repetition_penalty=1.3, min_tokens=6, ignore_eos=True,
        stop_token_ids=[7],
    )  # fmt: skip
    res = client.completions.create(
        model=SERVED_NAME,
        prompt="import os\n",
        max_tokens=12,
        temperature=0.8,
        seed=9,
        extra_body=extra,
    )
    assert [c.text for c in res.choices] == ref_text(
        reference, "import os\n", max_tokens=12, temperature=0.8, seed=9, **extra
    )


# ------------------------------------------------------------------------ usage


def test_cached_tokens_on_repeated_long_prompt(
    server: ServerProcess, client: openai.OpenAI, claude: anthropic.Anthropic, reference: LLM
) -> None:
    tok = reference.get_tokenizer()
    words = " ".join(f"item_{i} = {i * 7 % 13}" for i in range(80))
    ids = tok.encode(words)[:300]
    assert len(ids) == 300
    first = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens == 300
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text
    # The same through chat and the Anthropic API: the second turn reuses the first's prefix.
    long_chat = [{"role": "user", "content": tok.decode(ids)}]
    client.chat.completions.create(model=SERVED_NAME, messages=long_chat, max_tokens=2)
    chat = client.chat.completions.create(model=SERVED_NAME, messages=long_chat, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    msg = claude.messages.create(model=SERVED_NAME, messages=long_chat, max_tokens=2)
    assert msg.usage.cache_read_input_tokens > 0
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    samples = scrape(server.url)
    assert metric(samples, "metrale_prompt_tokens_cached_total") > 0
    assert metric(samples, "metrale_prefix_cache_hit_rate") > 0


def test_usage_present_on_every_response(server: ServerProcess) -> None:
    """Raw HTTP: `prompt_tokens_details.cached_tokens` is in every body and final chunk."""
    base = server.url
    bodies = [
        httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).json(),
        httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        ).json(),
    ]
    for body in bodies:
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0, body
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
    ) as r:
        frames = sse_json(r.iter_lines())
    assert frames[-1] == "[DONE]"
    last = frames[-2]
    assert isinstance(last, dict)
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


# -------------------------------------------------------------------- anthropic


def test_messages_same_tokens_as_llm_chat(claude: anthropic.Anthropic, reference: LLM) -> None:
    expected = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    msg = claude.messages.create(
        model=SERVED_NAME,
        system=CHAT[0]["content"],
        messages=[CHAT[1]],
        max_tokens=12,
        extra_body={"temperature": 0},
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text"
    assert msg.content[0].text == expected.outputs[0].text
    assert msg.stop_reason == (
        "max_tokens" if len(expected.outputs[0].token_ids) == 12 else "end_turn"
    )
    assert msg.usage.output_tokens == len(expected.outputs[0].token_ids)
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(
        expected.prompt_token_ids
    )
    with claude.messages.stream(
        model=SERVED_NAME,
        system=[{"type": "text", "text": CHAT[0]["content"]}],
        messages=[{"role": "user", "content": [{"type": "text", "text": CHAT[1]["content"]}]}],
        max_tokens=12,
        extra_body={"temperature": 0},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.outputs[0].text
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens


def test_messages_event_sequence(server: ServerProcess) -> None:
    body = {
        "model": SERVED_NAME,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/messages", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [name for name, _ in sse_events(r.iter_lines())]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta"}


# ---------------------------------------------------------------------- metrics


def test_sampler_metrics_count_the_candidate_draw(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    before = scrape(server.url)
    client.completions.create(
        model=SERVED_NAME,
        prompt="abc",
        max_tokens=4,
        temperature=0.8,
        top_p=0.95,
        seed=3,
        extra_body={"top_k": 5, "ignore_eos": True},
    )
    after = scrape(server.url)
    moved = metric(after, "metrale_sampler_batches_total", path="candidates") - metric(
        before, "metrale_sampler_batches_total", path="candidates"
    )
    assert moved >= 4  # every token of the request was drawn on its candidates


def test_metrics_parse_and_move(server: ServerProcess, client: openai.OpenAI) -> None:
    before = scrape(server.url)
    client.completions.create(
        model=SERVED_NAME, prompt="abc", max_tokens=5, extra_body={"ignore_eos": True}
    )
    list(client.completions.create(model=SERVED_NAME, prompt="abc", max_tokens=5, stream=True))
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "temperature": -1})
    after = scrape(server.url)

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("metrale_requests_total", endpoint="/v1/completions", status="200") == 2
    assert moved("metrale_requests_total", endpoint="/v1/completions", status="400") == 1
    assert moved("metrale_generation_tokens_total") >= 6
    assert moved("metrale_prompt_tokens_total") >= 2
    assert moved("metrale_time_to_first_token_seconds_count") == 2
    assert moved("metrale_inter_token_latency_seconds_count") >= 4
    assert moved("metrale_engine_steps_total") >= 5
    for gauge in (
        "metrale_num_requests_waiting",
        "metrale_num_requests_running",
        "metrale_kv_cache_usage_ratio",
        "metrale_prefix_cache_hit_rate",
    ):
        assert (gauge, ()) in after, gauge
    assert metric(after, "metrale_kv_blocks_total") == 255
    assert ("metrale_preemptions_total", (("mode", "recompute"),)) in after
    assert moved("metrale_forwards_total", path="eager") >= 5  # CPU: no graphs, every forward eager
    assert ("metrale_sampler_batches_total", (("path", "candidates"),)) in after
    assert ("metrale_sampler_rerouted_rows_total", ()) in after
    assert metric(after, "metrale_forwards_total", path="graph") == 0
    # The tiny model's weights are under the C GEMV's size bound: MKL runs its projections.
    assert moved("metrale_cpu_projections_total", path="torch") >= 5
    assert metric(after, "metrale_cpu_projections_total", path="gemv_unavailable") == 0
    # Its decode steps run the fused CPU step (every layer in one C call).
    assert moved("metrale_cpu_fused_decode_forwards_total") >= 1
    for series, labels in (
        ("metrale_prefix_cache_evicted_blocks_total", ()),
        ("metrale_prefix_cache_bypassed_lookups_total", ()),
        ("metrale_ssm_snapshot_slots_used", ()),  # 0: a dense model has no snapshot store
        ("metrale_ssm_snapshot_misses_total", (("cause", "evicted"),)),
        ("metrale_swapped_blocks_total", (("direction", "out"),)),
        ("metrale_swap_fallbacks_total", ()),
    ):
        assert (series, labels) in after, series
