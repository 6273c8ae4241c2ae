"""`metrale serve` applies the model's generation_config.json defaults, as vLLM does: a request
that leaves `repetition_penalty` unset gets the bundled model's 1.2, one that sends 1.0 gets
plain greedy, and `--generation-config none` serves the engine's own defaults.

Owner: tests (server). Serves the bundled `metrale-tiny-code` (its generation_config.json sets
`repetition_penalty: 1.2`) and compares with `LLM` on the same weights; the prompts are chosen
so that the two penalties give different tokens (asserted), so each check can fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from metrale import LLM, SamplingParams
from metrale.engine.engine import BUNDLED_MODEL_DIR
from tests.server.helpers import SERVED_NAME, ServerProcess

PROMPT = "def fibonacci(n):\n"
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
MAX_TOKENS = 32
MODEL_PENALTY = 1.2


def _serve(*args: str) -> ServerProcess:
    # `--model` overrides the positional test checkpoint ServerProcess passes.
    return ServerProcess("--model", str(BUNDLED_MODEL_DIR), "--num-kv-blocks", "128", *args)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = _serve()
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def bundled() -> LLM:
    """The engine's own defaults: every SamplingParams below is explicit."""
    return LLM(device="cpu", num_kv_blocks=128, enable_prefix_caching=False)


def _ref(llm: LLM, penalty: float) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=penalty)
    return llm.generate([PROMPT], params)[0].outputs[0].text


def _ref_chat(llm: LLM, penalty: float) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=penalty)
    return llm.chat(CHAT, params)[0].outputs[0].text


def test_llm_defaults_come_from_the_generation_config(bundled: LLM) -> None:
    assert bundled.get_default_sampling_params().repetition_penalty == MODEL_PENALTY
    default = bundled.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert default[0].outputs[0].text == _ref(bundled, 1.0)  # explicit params: used as given
    none = LLM(device="cpu", num_kv_blocks=64, generation_config="none")
    assert none.get_default_sampling_params() == SamplingParams()


def test_completion_without_penalty_gets_the_model_default(
    server: ServerProcess, client: openai.OpenAI, bundled: LLM
) -> None:
    model_default, plain = _ref(bundled, MODEL_PENALTY), _ref(bundled, 1.0)
    assert model_default != plain, "pick a prompt where the penalty changes the tokens"
    res = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert res.choices[0].text == model_default
    assert res.usage.completion_tokens == MAX_TOKENS
    assert "overridden by the model's generation config (repetition_penalty=1.2)" in server.log()
    overridden = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"repetition_penalty": 1.0},
    )
    assert overridden.choices[0].text == plain


def test_chat_without_penalty_gets_the_model_default(client: openai.OpenAI, bundled: LLM) -> None:
    model_default, plain = _ref_chat(bundled, MODEL_PENALTY), _ref_chat(bundled, 1.0)
    assert model_default != plain
    res = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert res.choices[0].message.content == model_default
    overridden = client.chat.completions.create(
        model=SERVED_NAME,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"repetition_penalty": 1.0},
    )
    assert overridden.choices[0].message.content == plain


def test_messages_get_the_model_default(server: ServerProcess, bundled: LLM) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = claude.messages.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}
    )
    assert msg.content[0].text == _ref_chat(bundled, MODEL_PENALTY)


def test_generation_config_none_serves_engine_defaults(bundled: LLM) -> None:
    proc = _serve("--generation-config", "none")
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        res = client.completions.create(
            model=SERVED_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert res.choices[0].text == _ref(bundled, 1.0)
        assert "overridden by the model's generation config" not in proc.log()
    finally:
        proc.close()
