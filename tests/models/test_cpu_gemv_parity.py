"""The CPU few-row C GEMV (`metrale.kernels.cpu_gemv`) inside the model: forced on every
float32 projection of at most 4 rows (`METRALE_CPU_LINEAR=gemv`, so the tiny checkpoints,
whose weights are below the default size bound, take it too), decode steps run it, and greedy
tokens stay identical to transformers with logprobs within the dense parity test's 1e-4."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.kernels import cpu_gemv, cpu_linear
from tests.helpers.checkpoints import DENSE_VARIANTS, build, load_hf
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.parity import assert_matches, hf_greedy, mixed_prompts

NEW_TOKENS = 24
#: A Qwen3 (q/k norm, GQA) and a Llama with attention bias (the kernel's bias) and head_dim 32.
VARIANTS = [v for v in DENSE_VARIANTS if v.name in ("qwen3-qknorm", "llama-headdim-yarn-bias")]


@pytest.fixture(autouse=True)
def _gemv_or_skip() -> None:
    try:
        cpu_gemv.load_gemv()
    except cpu_gemv.GemvUnavailable as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no C compiler here: {exc}")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_forced_gemv_matches_transformers(variant, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_CPU_LINEAR", "gemv")
    path = build(variant)
    prompts = mixed_prompts(cpu_gemv.MAX_ROWS, seed=3)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=160)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=5)
    outs = llm.generate(prompts, params)
    counters = llm.engine.model.forward_counters()
    # Decode steps (<= 4 rows) ran the kernel; prefill chunks (more rows) ran oneDNN / F.linear.
    assert counters["cpu_projection_gemv"] >= NEW_TOKENS - 1
    assert counters["cpu_projection_onednn"] + counters["cpu_projection_torch"] > 0
    assert counters["cpu_projection_gemv_unavailable"] == 0
    assert llm.engine.model.kernel_implementations["linear"] == "gemv+onednn"
    hf = load_hf(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out, hf_greedy(hf, prompt, NEW_TOKENS))
    assert_no_leaks(llm.engine)


def test_default_mode_keeps_small_weights_on_f_linear() -> None:
    """The default (`auto`) leaves weights under `MIN_ELEMENTS` to MKL: the tiny checkpoints'
    projections never take the kernel unless forced (why the test above forces it)."""
    variant = VARIANTS[0]
    llm = LLM(str(build(variant)), device="cpu", dtype="float32", num_kv_blocks=64)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    counters = llm.engine.model.forward_counters()
    assert counters["cpu_projection_gemv"] == 0 and counters["cpu_projection_torch"] > 0
    assert cpu_linear.mode_from_env() == "auto"
