"""`load_sampling_defaults`: the model's generation_config.json as default sampling parameters
(vLLM's keys only, validated like `SamplingParams`), and how the request mappings apply them.

Owner: tests (sampling).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale.config import EngineConfig
from metrale.errors import CheckpointError, InvalidRequestError
from metrale.sampling.defaults import SamplingDefaults, load_sampling_defaults
from metrale.sampling.params import SamplingParams
from metrale.server.protocol.anthropic import MessagesRequest
from metrale.server.protocol.openai import CompletionRequest


def write(tmp_path: Path, data: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(data), encoding="utf-8")
    return tmp_path


def test_missing_file_gives_empty_defaults(tmp_path: Path) -> None:
    defaults = load_sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults()
    assert not defaults and defaults.as_dict() == {}
    assert defaults.sampling_params() == SamplingParams()


def test_reads_vllms_keys_and_ignores_the_others(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "bos_token_id": 1,
            "eos_token_id": [2, 5],
            "do_sample": True,
            "max_new_tokens": 77,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20.0,
            "min_p": 0,
            "repetition_penalty": 1.05,
            "presence_penalty": 1.5,
        },
    )
    defaults = load_sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05
    )
    assert type(defaults.top_k) is int and type(defaults.min_p) is float
    params = defaults.sampling_params(max_tokens=5)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.6, 20, 1.05)
    assert params.presence_penalty == 0.0 and params.max_tokens == 5


def test_null_and_absent_keys_are_not_given(tmp_path: Path) -> None:
    write(tmp_path, {"temperature": None, "repetition_penalty": 1.2})
    assert load_sampling_defaults(tmp_path) == SamplingDefaults(repetition_penalty=1.2)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", "0.7"),
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", [1.2]),
    ],
)
def test_bad_value_names_file_and_key(tmp_path: Path, key: str, value: object) -> None:
    write(tmp_path, {key: value})
    with pytest.raises(CheckpointError, match=r"generation_config\.json") as info:
        load_sampling_defaults(tmp_path)
    assert f"'{key}'" in info.value.message


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"text"'])
def test_malformed_file_names_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "generation_config.json").write_text(text, encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        load_sampling_defaults(tmp_path)


def test_pick_request_then_model_then_engine() -> None:
    defaults = SamplingDefaults(temperature=0.6, repetition_penalty=1.2)
    assert defaults.pick("temperature", 0.0) == 0.0  # set by the request: wins
    assert defaults.pick("temperature", None) == 0.6  # the model's
    assert defaults.pick("top_p", None) == 1.0  # the engine's
    assert defaults.pick("presence_penalty", None) == 0.0  # a field the model cannot set


def test_request_mappings_apply_the_defaults() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_k=20, repetition_penalty=1.2)
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0})
    params = req.sampling_params(max_tokens=8, logprobs=None, defaults=defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 20, 1.2)
    explicit = CompletionRequest.model_validate({"prompt": "x", "repetition_penalty": 1.0})
    params = explicit.sampling_params(max_tokens=8, logprobs=None, defaults=defaults)
    assert (params.temperature, params.repetition_penalty) == (0.6, 1.0)
    plain = req.sampling_params(max_tokens=8, logprobs=None)
    assert (plain.top_k, plain.repetition_penalty) == (0, 1.0)
    msg = MessagesRequest.model_validate({"max_tokens": 4, "messages": [], "top_k": 5})
    params = msg.sampling_params(defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.6, 5, 1.2)


def test_engine_config_generation_config_values() -> None:
    assert EngineConfig().generation_config == "auto"
    assert EngineConfig().uses_generation_config
    assert not EngineConfig(generation_config="none").uses_generation_config
    assert not EngineConfig(generation_config="vllm").uses_generation_config
    with pytest.raises(InvalidRequestError, match="generation_config"):
        EngineConfig(generation_config="/some/dir")


def test_bundled_model_sets_repetition_penalty() -> None:
    from metrale.engine.engine import BUNDLED_MODEL_DIR

    assert load_sampling_defaults(BUNDLED_MODEL_DIR) == SamplingDefaults(repetition_penalty=1.2)
