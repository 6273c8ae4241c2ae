"""The recurrent-layer decode kernels (`metrale.kernels.triton_ssm`) against their torch
references (`metrale.kernels.ssm_reference`).

Marked `gpu`: runs on a CUDA device (tiny shapes and the Nemotron-H-8B / Qwen3-Next shapes), or
on the CPU under Triton's interpreter with `METRALE_TRITON_INTERPRET=1` (tiny shapes only).
References run on the CPU in float64 from the same (dtype-rounded) inputs. Every launch holds
a padding row (slot -1, as a CUDA-graph rung pads the batch): it must leave every slot as the
reference leaves it, bit for bit for slots no real row names.
"""

from __future__ import annotations

import os

import pytest
import torch

from metrale.kernels import ssm_reference

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

triton_ssm = pytest.importorskip("metrale.kernels.triton_ssm")
triton_ssm_prefill = pytest.importorskip("metrale.kernels.triton_ssm_prefill")

#: Relative error bounds by dtype (float64 reference); the kernels round only their outputs.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16]
#: Pool slots per test; the rows name some of them (one padding row names none).
POOL = 6
SLOTS = [4, 0, -1, 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.detach().double().cpu()
    ref64 = ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), "non-finite (unwritten or NaN) output elements"
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def randn(*shape: int, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def real_rows() -> tuple[list[int], torch.Tensor]:
    """The indices of the non-padding rows and their slots (CPU int64)."""
    rows = [i for i, s in enumerate(SLOTS) if s >= 0]
    return rows, torch.tensor([SLOTS[i] for i in rows], dtype=torch.int64)


def dev_slots() -> torch.Tensor:
    return torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE)


def check_states(after: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, tol: float) -> None:
    """Named slots match the reference; slots no real row names are untouched bit for bit."""
    named = {s for s in SLOTS if s >= 0}
    after = after.cpu()
    for slot in range(POOL):
        if slot in named:
            assert rel_err(after[slot], ref[slot]) <= tol, f"slot {slot}"
        else:
            assert torch.equal(after[slot], before[slot]), f"untouched slot {slot} changed"


def shapes(tiny: list[tuple[int, ...]], full: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    return tiny if INTERPRET else tiny + full


# -------------------------------------------------------------------------------------------
# causal conv1d update
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize(
    "channels,width",
    # Nemotron-H-8B mamba conv (intermediate 8192 + 2 * 8 groups * 128), Qwen3-Next's q|k|v.
    shapes([(40, 4), (24, 3)], [(10240, 4), (8192, 4)]),
)
def test_causal_conv1d_update(
    dtype: torch.dtype, activation: str | None, channels: int, width: int
) -> None:
    g = torch.Generator().manual_seed(1)
    n = len(SLOTS)
    # x as a strided view (a split of a wider projection output), as the layers pass it.
    wide = randn(n, channels + 8, dtype=dtype, g=g)
    weight = randn(channels, width, dtype=dtype, g=g, scale=0.5)
    bias = randn(channels, dtype=dtype, g=g) if activation else None
    states = randn(POOL, channels, width, dtype=dtype, g=g)
    rows, slots = real_rows()
    ref_states = states.double()
    ref = ssm_reference.causal_conv1d_update(
        wide[rows, 4 : 4 + channels].double(), weight.double(),
        bias.double() if bias is not None else None, ref_states, slots, activation,
    )  # fmt: skip
    dev_states = states.to(DEVICE)
    out = triton_ssm.causal_conv1d_update(
        wide.to(DEVICE)[:, 4 : 4 + channels], weight.to(DEVICE),
        bias.to(DEVICE) if bias is not None else None, dev_states, dev_slots(), activation,
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == (n, channels)
    assert rel_err(out[rows], ref) < TOL[dtype]
    assert torch.isfinite(out.double()).all()
    # The window is a shift of stored values: exact in any dtype.
    check_states(dev_states, ref_states.to(dtype), states, 0.0)


def test_causal_conv1d_update_rejects_unknown_activation() -> None:
    x = torch.zeros(1, 8, device=DEVICE)
    states = torch.zeros(2, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="unsupported activation 'tanh'"):
        triton_ssm.causal_conv1d_update(
            x, torch.zeros(8, 4, device=DEVICE), None, states,
            torch.zeros(1, dtype=torch.int64, device=DEVICE), "tanh",
        )  # fmt: skip


# -------------------------------------------------------------------------------------------
# Mamba-2 state update
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,head_dim,groups,d_state",
    # Nemotron-H-8B: 128 heads of 64, 8 groups, state 128; Bamba-9B: 128 x 64, 1 group.
    shapes([(4, 8, 2, 16), (6, 5, 1, 12)], [(128, 64, 8, 128), (128, 64, 1, 128)]),
)
def test_mamba2_state_update(
    dtype: torch.dtype, heads: int, head_dim: int, groups: int, d_state: int
) -> None:
    g = torch.Generator().manual_seed(2)
    n = len(SLOTS)
    x = randn(n, heads, head_dim, dtype=dtype, g=g)
    dt = randn(n, heads, dtype=dtype, g=g)
    # One large raw dt: softplus's linear branch (threshold 20).
    dt[0, 0] = 21.0
    a = -torch.rand(heads, generator=g) * 4 - 0.1
    bc = randn(n, 2, groups, d_state, dtype=dtype, g=g)
    b, c = bc[:, 0], bc[:, 1]  # strided views, as the layer's split gives them
    d = randn(heads, dtype=dtype, g=g)
    dt_bias = randn(heads, dtype=dtype, g=g, scale=0.5)
    states = torch.randn(POOL, heads, head_dim, d_state, generator=g)
    rows, slots = real_rows()
    ref_states = states.double()
    ref = ssm_reference.mamba2_state_update(
        x[rows].double(), dt[rows].double(), a.double(), b[rows].double(), c[rows].double(),
        d.double(), dt_bias.double(), ref_states, slots,
    )  # fmt: skip
    dev_states = states.to(DEVICE)
    out = triton_ssm.mamba2_state_update(
        *(t.to(DEVICE) for t in (x, dt, a, b, c, d, dt_bias)), dev_states, dev_slots()
    )
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out[rows], ref) < TOL[dtype]
    assert torch.isfinite(out.double()).all()
    check_states(dev_states, ref_states, states, 2e-6)


# -------------------------------------------------------------------------------------------
# Gated delta rule update
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "k_heads,v_heads,dk,dv",
    # Qwen3-Next-80B: 16 key heads, 32 value heads, 128 x 128.
    shapes([(2, 4, 16, 8), (3, 3, 12, 20)], [(16, 32, 128, 128)]),
)
def test_gated_delta_update(
    dtype: torch.dtype, k_heads: int, v_heads: int, dk: int, dv: int
) -> None:
    g = torch.Generator().manual_seed(3)
    n = len(SLOTS)
    qk = randn(n, 2, k_heads, dk, dtype=dtype, g=g)
    q, k = qk[:, 0], qk[:, 1]
    v = randn(n, v_heads, dv, dtype=dtype, g=g)
    decay = -torch.rand(n, v_heads, generator=g) * 2  # float32, as the layer computes it
    beta = torch.rand(n, v_heads, generator=g).to(dtype)
    states = torch.randn(POOL, v_heads, dk, dv, generator=g) * 0.3
    rows, slots = real_rows()
    ref_states = states.double()
    ref = ssm_reference.gated_delta_update(
        q[rows].double(), k[rows].double(), v[rows].double(), decay[rows].double(),
        beta[rows].double(), ref_states, slots,
    )  # fmt: skip
    dev_states = states.to(DEVICE)
    out = triton_ssm.gated_delta_update(
        *(t.to(DEVICE) for t in (q, k, v, decay, beta)), dev_states, dev_slots()
    )
    assert out.dtype == dtype and out.shape == v.shape
    assert rel_err(out[rows], ref) < TOL[dtype]
    assert torch.isfinite(out.double()).all()
    check_states(dev_states, ref_states, states, 2e-6)


def test_ssm_kernels_reject_mismatched_states() -> None:
    x = torch.zeros(1, 2, 4, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="mamba2_state_update: SSM states"):
        triton_ssm.mamba2_state_update(
            x, torch.zeros(1, 2, device=DEVICE), torch.zeros(2, device=DEVICE),
            torch.zeros(1, 1, 8, device=DEVICE), torch.zeros(1, 1, 8, device=DEVICE),
            torch.zeros(2, device=DEVICE), torch.zeros(2, device=DEVICE),
            torch.zeros(3, 2, 4, 9, device=DEVICE), slots,
        )  # fmt: skip
    with pytest.raises(ValueError, match="slots must be"):
        triton_ssm.gated_delta_update(
            x, x, x, torch.zeros(1, 2, device=DEVICE), torch.zeros(1, 2, device=DEVICE),
            torch.zeros(3, 2, 4, 4, device=DEVICE), torch.zeros(2, dtype=torch.int64),
        )  # fmt: skip


# -------------------------------------------------------------------------------------------
# Prefill (varlen): conv over chunks, the sequential scans of short chunks
# -------------------------------------------------------------------------------------------

#: Chunks of one prefill batch: lengths (some shorter than the conv window), whether each
#: continues a carried state, and their slots.
LENGTHS = [5, 1, 13, 2]
INITIAL = [True, False, True, True]
PREFILL_SLOTS = [3, 0, 5, 1]


def qsl() -> list[int]:
    out = [0]
    for n in LENGTHS:
        out.append(out[-1] + n)
    return out


def check_prefill_states(
    after: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, tol: float
) -> None:
    after = after.cpu()
    for slot in range(POOL):
        if slot in PREFILL_SLOTS:
            assert rel_err(after[slot], ref[slot]) <= tol, f"slot {slot}"
        else:
            assert torch.equal(after[slot], before[slot]), f"untouched slot {slot} changed"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("channels,width", shapes([(40, 4), (24, 3)], [(10240, 4), (8192, 4)]))
def test_causal_conv1d_varlen(
    dtype: torch.dtype, activation: str | None, channels: int, width: int
) -> None:
    g = torch.Generator().manual_seed(4)
    tokens = sum(LENGTHS)
    wide = randn(tokens, channels + 8, dtype=dtype, g=g)
    weight = randn(channels, width, dtype=dtype, g=g, scale=0.5)
    bias = randn(channels, dtype=dtype, g=g) if activation else None
    states = randn(POOL, channels, width, dtype=dtype, g=g)
    ref_states = states.double()
    ref = ssm_reference.causal_conv1d_varlen(
        wide[:, 4 : 4 + channels].double(), weight.double(),
        bias.double() if bias is not None else None, ref_states, qsl(), PREFILL_SLOTS, INITIAL,
        activation,
    )  # fmt: skip
    dev_states = states.to(DEVICE)
    out = triton_ssm_prefill.causal_conv1d_varlen(
        wide.to(DEVICE)[:, 4 : 4 + channels], weight.to(DEVICE),
        bias.to(DEVICE) if bias is not None else None, dev_states, qsl(), PREFILL_SLOTS,
        INITIAL, activation,
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == (tokens, channels)
    assert rel_err(out, ref) < TOL[dtype]
    check_prefill_states(dev_states, ref_states.to(dtype), states, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,head_dim,groups,d_state",
    shapes([(4, 8, 2, 16), (6, 5, 1, 12)], [(128, 64, 8, 128)]),
)
def test_mamba2_chunk_scan_varlen(
    dtype: torch.dtype, heads: int, head_dim: int, groups: int, d_state: int
) -> None:
    g = torch.Generator().manual_seed(5)
    tokens = sum(LENGTHS)
    x = randn(tokens, heads, head_dim, dtype=dtype, g=g)
    dt = randn(tokens, heads, dtype=dtype, g=g)
    a = -torch.rand(heads, generator=g) * 4 - 0.1
    bc = randn(tokens, 2, groups, d_state, dtype=dtype, g=g)
    b, c = bc[:, 0], bc[:, 1]
    d = randn(heads, dtype=dtype, g=g)
    dt_bias = randn(heads, dtype=dtype, g=g, scale=0.5)
    limit = (0.05, 2.0)  # both bounds bite on these draws
    states = torch.randn(POOL, heads, head_dim, d_state, generator=g)
    ref_states = states.clone()
    # The reference in float32 (its softplus and clamp run in dt's dtype, as the kernel's).
    ref = ssm_reference.mamba2_chunk_scan_varlen(
        x, dt, a, b, c, d, dt_bias, limit, 4, ref_states, qsl(), PREFILL_SLOTS, INITIAL
    )
    dev_states = states.to(DEVICE)
    out = triton_ssm_prefill.mamba2_chunk_scan_varlen(
        *(t.to(DEVICE) for t in (x, dt, a, b, c, d, dt_bias)), limit, 4, dev_states, qsl(),
        PREFILL_SLOTS, INITIAL,
    )  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert rel_err(out, ref) < 2e-5
    check_prefill_states(dev_states, ref_states, states, 2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "k_heads,v_heads,dk,dv", shapes([(2, 4, 16, 8), (3, 3, 12, 20)], [(16, 32, 128, 128)])
)
def test_gated_delta_chunk_varlen(
    dtype: torch.dtype, k_heads: int, v_heads: int, dk: int, dv: int
) -> None:
    g = torch.Generator().manual_seed(6)
    tokens = sum(LENGTHS)
    qk = randn(tokens, 2, k_heads, dk, dtype=dtype, g=g)
    q, k = qk[:, 0], qk[:, 1]
    v = randn(tokens, v_heads, dv, dtype=dtype, g=g)
    decay = -torch.rand(tokens, v_heads, generator=g) * 2
    beta = torch.rand(tokens, v_heads, generator=g).to(dtype)
    states = torch.randn(POOL, v_heads, dk, dv, generator=g) * 0.3
    ref_states = states.double()
    ref = ssm_reference.gated_delta_chunk_varlen(
        q.double(), k.double(), v.double(), decay.double(), beta.double(), ref_states, qsl(),
        PREFILL_SLOTS, INITIAL, chunk_size=4,
    )  # fmt: skip
    dev_states = states.to(DEVICE)
    out = triton_ssm_prefill.gated_delta_chunk_varlen(
        *(t.to(DEVICE) for t in (q, k, v, decay, beta)), dev_states, qsl(), PREFILL_SLOTS,
        INITIAL, chunk_size=4,
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == v.shape
    assert rel_err(out, ref) < TOL[dtype]
    check_prefill_states(dev_states, ref_states, states, 2e-5)


def test_long_chunks_take_the_chunked_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `SCAN_MAX_TOKENS` the scans route the call to the torch chunked form, whose result
    (the same function) they return unchanged."""
    monkeypatch.setattr(triton_ssm_prefill, "SCAN_MAX_TOKENS", 4)  # the 13-token chunk is long
    g = torch.Generator().manual_seed(7)
    tokens = sum(LENGTHS)
    q, k = (
        randn(tokens, 2, 8, dtype=torch.float32, g=g),
        randn(tokens, 2, 8, dtype=torch.float32, g=g),
    )
    v = randn(tokens, 2, 4, dtype=torch.float32, g=g)
    decay, beta = -torch.rand(tokens, 2, generator=g), torch.rand(tokens, 2, generator=g)
    states = torch.randn(POOL, 2, 8, 4, generator=g)

    def inputs() -> list[torch.Tensor]:
        return [t.to(DEVICE, copy=True) for t in (q, k, v, decay, beta)]

    # The reference on the same device: the routed call must return exactly its result.
    ref_states = states.to(DEVICE, copy=True)
    ref = ssm_reference.gated_delta_chunk_varlen(
        *inputs(), ref_states, qsl(), PREFILL_SLOTS, INITIAL, chunk_size=4
    )
    dev_states = states.to(DEVICE, copy=True)
    out = triton_ssm_prefill.gated_delta_chunk_varlen(
        *inputs(), dev_states, qsl(), PREFILL_SLOTS, INITIAL, chunk_size=4
    )
    assert torch.equal(out, ref) and torch.equal(dev_states, ref_states)


def test_varlen_ops_reject_a_bad_layout() -> None:
    x = torch.zeros(3, 8, device=DEVICE)
    states = torch.zeros(2, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="do not describe one batch"):
        triton_ssm_prefill.causal_conv1d_varlen(
            x, torch.zeros(8, 4, device=DEVICE), None, states, [0, 3], [0, 1], [False], "silu"
        )
    with pytest.raises(ValueError, match="needs a pool slot"):
        triton_ssm_prefill.causal_conv1d_varlen(
            x, torch.zeros(8, 4, device=DEVICE), None, states, [0, 3], [-1], [False], "silu"
        )
