"""SamplingParams: validation names the bad parameter, normalisation, derived views, seeds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import metrale.sampling
from metrale.errors import InvalidRequestError
from metrale.sampling.params import SamplingParams, derive_choice_seed

BAD_VALUES: list[tuple[str, Any]] = [
    ("n", 0),
    ("n", -3),
    ("n", 1.5),
    ("n", "2"),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {"5": -100.5}),
    ("logit_bias", {"five": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {1.5: 1.0}),
    ("logit_bias", {5: float("nan")}),
    ("logit_bias", [1, 2]),
    ("logit_bias", {5: 1.0, "5": 2.0}),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 7),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["x"]),
    ("stop_token_ids", 3),
    ("seed", 1.5),
    ("seed", "42"),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_names_the_parameter(name: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{name: value})
    assert info.value.param == name
    assert name in info.value.message
    assert info.value.status_code == 400


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_tokens=10, max_tokens=5)
    assert info.value.param == "min_tokens"
    assert "max_tokens" in info.value.message
    # Without a max_tokens bound any min_tokens is fine.
    assert SamplingParams(min_tokens=10, max_tokens=None).min_tokens == 10


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.logit_bias is None and p.seed is None
    assert (p.max_tokens, p.min_tokens) == (16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.uses_penalties
    assert not p.top_k_filters(vocab=1000) and not p.top_p_enabled and not p.min_p_enabled


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logprobs=20,
        prompt_logprobs=0,
        max_tokens=1,
        logit_bias={3: -100, 4: 100},
    )
    assert p.is_greedy and not p.top_k_filters(vocab=1000)
    assert p.logit_bias == {3: -100.0, 4: 100.0}


def test_normalisation() -> None:
    p = SamplingParams(
        stop="END",
        stop_token_ids=(7, 8),
        logit_bias={"12": 5, " 13 ": -1.5},
        n=2.0,
        max_tokens=8.0,
        temperature=1,
    )
    assert p.stop == ["END"]
    assert p.stop_token_ids == [7, 8]
    assert p.logit_bias == {12: 5.0, 13: -1.5}
    assert all(type(k) is int for k in p.logit_bias)
    assert type(p.n) is int and p.n == 2
    assert type(p.max_tokens) is int and p.max_tokens == 8
    assert type(p.temperature) is float
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


def test_is_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_stop_reason_and_masked_stop_token_ids() -> None:
    p = SamplingParams(stop_token_ids=[5, 2], min_tokens=2)
    eos = frozenset({2, 3})
    # Before min_tokens nothing stops, and every stop token and EOS id is masked.
    assert not p.stop_tokens_allowed(1) and p.stop_reason(5, 1, eos) == (None, None)
    assert p.masked_stop_token_ids(eos) == frozenset({2, 3, 5})
    # Then stop_token_ids stop with their id, checked before EOS, and EOS stops without one.
    assert p.stop_reason(5, 2, eos) == ("stop", 5)
    assert p.stop_reason(2, 2, eos) == ("stop", 2)
    assert p.stop_reason(3, 2, eos) == ("stop", None)
    assert p.stop_reason(4, 2, eos) == (None, None)
    # ignore_eos only keeps EOS from stopping: it stays masked before min_tokens.
    q = p.replace(ignore_eos=True)
    assert q.stop_reason(3, 2, eos) == (None, None) and q.stop_reason(5, 2, eos) == ("stop", 5)
    assert q.masked_stop_token_ids(eos) == frozenset({2, 3, 5})


def test_replace_validates_and_clone_does_not_share() -> None:
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    q = p.replace(temperature=0.5)
    assert q.temperature == 0.5 and p.temperature == 1.0
    q.stop.append("b")
    assert p.stop == ["a"]
    c = p.clone()
    assert c == p and c.logit_bias is not p.logit_bias
    with pytest.raises(InvalidRequestError) as info:
        p.replace(top_p=0.0)
    assert info.value.param == "top_p"


def test_validate_for_vocab() -> None:
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).validate_for_vocab(10)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={10: 1.0}).validate_for_vocab(10)
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=[10]).validate_for_vocab(10)
    assert info.value.param == "stop_token_ids"


def test_derive_choice_seed() -> None:
    assert derive_choice_seed(None, 3) is None
    assert derive_choice_seed(1234, 0) == 1234
    seeds = {derive_choice_seed(1234, i) for i in range(64)}
    assert len(seeds) == 64
    assert derive_choice_seed(1234, 5) == derive_choice_seed(1234, 5)
    assert derive_choice_seed(1234, 5) != derive_choice_seed(1235, 5)
    # Any Python int seed works (negative, beyond 64 bits) and stays in torch's seed range.
    for seed in (-1, 2**70 + 3):
        derived = derive_choice_seed(seed, 1)
        assert derived is not None and 0 <= derived < 2**64


def test_params_module_does_not_import_torch() -> None:
    # The package root (metrale/__init__.py) is stubbed: this checks the sampling package's own
    # import graph (metrale.sampling, .params, metrale.errors), which the scheduler core uses.
    package_dir = Path(metrale.sampling.__file__).resolve().parent.parent
    code = (
        "import sys, types\n"
        "root = types.ModuleType('metrale')\n"
        f"root.__path__ = [{str(package_dir)!r}]\n"
        "sys.modules['metrale'] = root\n"
        "import metrale.sampling\n"
        "from metrale.sampling.params import SamplingParams\n"
        "SamplingParams(temperature=0.5)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
