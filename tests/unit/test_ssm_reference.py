"""The recurrent reference ops: chunked forms equal step-by-step recurrence from a carried
state (lengths that do not divide the chunk, several sequences in one varlen call, grouped
heads), and agree with transformers' own torch fallbacks given the same initial state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels import ssm_reference as ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_conv1d_varlen_in_pieces_equals_one_pass_and_steps() -> None:
    g = _gen(0)
    channels, width, length = 6, 4, 23
    x = torch.randn(length, channels, generator=g)
    weight = torch.randn(channels, width, generator=g)
    bias = torch.randn(channels, generator=g)
    whole_state = torch.zeros(1, channels, width)
    whole = ref.causal_conv1d_varlen(
        x, weight, bias, whole_state, [0, length], [0], [False], "silu"
    )
    # Same sequence fed as 3 chunks (carried window) and then as single steps.
    pieces_state = torch.full((2, channels, width), 9.0)  # garbage in the slot: must be ignored
    cuts = [0, 5, 6, 23]
    outs = []
    for i in range(3):
        seg = x[cuts[i] : cuts[i + 1]]
        outs.append(
            ref.causal_conv1d_varlen(
                seg, weight, bias, pieces_state, [0, len(seg)], [1], [i > 0], "silu"
            )
        )
    torch.testing.assert_close(torch.cat(outs), whole)
    torch.testing.assert_close(pieces_state[1], whole_state[0])
    step_state = torch.zeros(1, channels, width)
    slots = torch.tensor([0])
    steps = [
        ref.causal_conv1d_update(x[t : t + 1], weight, bias, step_state, slots, "silu")
        for t in range(length)
    ]
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(step_state[0], whole_state[0])


def _mamba_inputs(length: int, seed: int) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    heads, head_dim, groups, d_state = 4, 3, 2, 5
    return {
        "x": torch.randn(length, heads, head_dim, generator=g),
        "dt": torch.randn(length, heads, generator=g),
        "a": -torch.rand(heads, generator=g) * 2,
        "b": torch.randn(length, groups, d_state, generator=g),
        "c": torch.randn(length, groups, d_state, generator=g),
        "d": torch.randn(heads, generator=g),
        "dt_bias": torch.randn(heads, generator=g),
        "init": torch.randn(heads, head_dim, d_state, generator=g),
    }


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_mamba2_chunk_scan_equals_recurrence_from_a_carried_state(chunk_size: int) -> None:
    lengths = [1, 13, 30]  # three sequences in one varlen call, none a chunk multiple
    inputs = [_mamba_inputs(n, seed) for seed, n in enumerate(lengths)]
    cat = {k: torch.cat([i[k] for i in inputs]) for k in ("x", "dt", "b", "c")}
    a, d, dt_bias = inputs[0]["a"], inputs[0]["d"], inputs[0]["dt_bias"]
    pool = torch.stack([i["init"] for i in inputs])
    qsl = [0, 1, 14, 44]
    y = ref.mamba2_chunk_scan_varlen(
        cat["x"], cat["dt"], a, cat["b"], cat["c"], d, dt_bias, (0.0, float("inf")), chunk_size,
        pool, qsl, [0, 1, 2], [True, True, True],
    )  # fmt: skip
    for s, inp in enumerate(inputs):
        state = inp["init"].clone()[None]
        slots = torch.tensor([0])
        for t in range(lengths[s]):
            row = qsl[s] + t
            out = ref.mamba2_state_update(
                inp["x"][t : t + 1], inp["dt"][t : t + 1], a, inp["b"][t : t + 1],
                inp["c"][t : t + 1], d, dt_bias, state, slots,
            )  # fmt: skip
            torch.testing.assert_close(y[row], out[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[s], state[0], rtol=1e-4, atol=1e-5)


def test_mamba2_chunk_scan_matches_transformers_with_initial_state() -> None:
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    inp = _mamba_inputs(37, seed=7)
    pool = inp["init"][None].clone()
    y = ref.mamba2_chunk_scan_varlen(
        inp["x"], inp["dt"], inp["a"], inp["b"], inp["c"], inp["d"], inp["dt_bias"],
        (0.001, float("inf")), 16, pool, [0, 37], [0], [True],
    )  # fmt: skip
    hf_y, hf_state = hf.mamba2_chunk_scan(
        inp["x"][None], inp["dt"][None], inp["a"], inp["b"][None], inp["c"][None], chunk_size=8,
        D=inp["d"], dt_bias=inp["dt_bias"], initial_states=inp["init"][None], dt_softplus=True,
        dt_limit=(0.001, float("inf")), return_final_states=True,
    )  # fmt: skip
    torch.testing.assert_close(y, hf_y[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[0], hf_state[0], rtol=1e-4, atol=1e-5)


def _delta_inputs(length: int, seed: int) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    hk, hv, dk, dv = 2, 4, 8, 6
    return {
        "q": torch.randn(length, hk, dk, generator=g),
        "k": torch.randn(length, hk, dk, generator=g),
        "v": torch.randn(length, hv, dv, generator=g),
        "g": -F.softplus(torch.randn(length, hv, generator=g)),
        "beta": torch.rand(length, hv, generator=g),
        "init": torch.randn(hv, dk, dv, generator=g),
    }


@pytest.mark.parametrize("chunk_size", [8, 64])
def test_gated_delta_chunk_equals_recurrence_from_a_carried_state(chunk_size: int) -> None:
    lengths = [3, 70]
    inputs = [_delta_inputs(n, seed) for seed, n in enumerate(lengths)]
    cat = {k: torch.cat([i[k] for i in inputs]) for k in ("q", "k", "v", "g", "beta")}
    pool = torch.stack([i["init"] for i in inputs])
    out = ref.gated_delta_chunk_varlen(
        cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], pool, [0, 3, 73], [0, 1],
        [True, True], chunk_size=chunk_size,
    )  # fmt: skip
    start = 0
    for s, inp in enumerate(inputs):
        state = inp["init"].clone()[None]
        slots = torch.tensor([0])
        for t in range(lengths[s]):
            o = ref.gated_delta_update(
                inp["q"][t : t + 1], inp["k"][t : t + 1], inp["v"][t : t + 1],
                inp["g"][t : t + 1], inp["beta"][t : t + 1], state, slots,
            )  # fmt: skip
            torch.testing.assert_close(out[start + t], o[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[s], state[0], rtol=1e-4, atol=1e-5)
        start += lengths[s]


def test_gated_delta_matches_transformers_chunked_and_recurrent() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    inp = _delta_inputs(45, seed=3)
    args = [inp[k][None] for k in ("q", "k", "v", "g", "beta")]
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(
        *args, initial_state=inp["init"][None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    pool = inp["init"][None].clone()
    out = ref.gated_delta_chunk_varlen(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, [0, 45], [0], [True]
    )
    torch.testing.assert_close(out, hf_out[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[0], hf_state[0], rtol=1e-4, atol=1e-5)
    step_args = [inp[k][:1][None] for k in ("q", "k", "v", "g", "beta")]
    hf_step, hf_step_state = hf.torch_recurrent_gated_delta_rule(
        *step_args, initial_state=inp["init"][None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    state = inp["init"][None].clone()
    step = ref.gated_delta_update(
        inp["q"][:1], inp["k"][:1], inp["v"][:1], inp["g"][:1], inp["beta"][:1], state,
        torch.tensor([0]),
    )  # fmt: skip
    torch.testing.assert_close(step, hf_step[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[0], hf_step_state[0], rtol=1e-5, atol=1e-6)


def test_fresh_sequences_ignore_what_their_slot_held() -> None:
    inp = _delta_inputs(10, seed=5)
    garbage = torch.full((1, *inp["init"].shape), 3.0)
    zeros = torch.zeros_like(garbage)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    a = ref.gated_delta_chunk_varlen(*args, garbage, [0, 10], [0], [False])
    b = ref.gated_delta_chunk_varlen(*args, zeros, [0, 10], [0], [True])
    assert torch.equal(a, b) and torch.equal(garbage, zeros)
