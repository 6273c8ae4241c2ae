"""Multi-LoRA's epilogue form (`triton_lora_epilogue`): the shrink, then the base GEMV adding
each row's delta as it stores, equals the plain GEMV plus `lora_reference.lora_gather_add`,
for every GEMV config family (unsplit, and split-K through the reduce kernel), bf16 / fp16 /
fp32, 1 to `PLAN_MIN_ROWS - 1` rows with base rows (slot -1) mixed in, adapters of rank
below the stacks' rank, a q/k/v-like group of three targets and the down projection with
SiLU-and-mul fused (`act`); and `triton_linear.lora_linear` equals its reference on both of
its paths (the epilogue at GEMV rows, the projection then the gather op beyond).

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from metrale.kernels import lora_reference, reference, triton_linear, triton_lora
from metrale.kernels.triton_gemv import GemvConfig, gemv, gemv_silu_mul
from metrale.kernels.triton_lora_epilogue import lora_shrink
from metrale.layers.lora import PLAN_MIN_ROWS

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

#: Slot stacks of rank 16; slot 1 holds a rank-8 adapter (rows past it zero), slot 2 adapts
#: only the first target (the others' A rows and B columns zero, their scale 0).
MAX_RANK, SLOTS = 16, 3
#: (targets' widths, input features): a q/k/v-like group (column tiles straddle the
#: targets' borders; K not a multiple of the K tile) and a down projection.
GROUPS = {"qkv": ((48, 24, 24), 320), "down": ((72,), 200)}
#: The unsplit default config, and a split-K one (the partials summed by the reduce kernel).
CONFIGS = {"unsplit": None, "split_k": GemvConfig(block_n=8, block_k=64, split_k=3)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Every row count below the plan's, group and config family, the dtype rotating (each
#: family meets each dtype); plus one row in every dtype (the batch-1 decode case).
CASES = [
    (rows, group, DTYPES[(rows + i) % 3], config)
    for rows in range(1, PLAN_MIN_ROWS)
    for i, (group, config) in enumerate((g, c) for g in GROUPS for c in CONFIGS)
] + [(1, group, dtype, "unsplit") for group in GROUPS for dtype in DTYPES]
CASES = list(dict.fromkeys(CASES))


def _group(
    name: str, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], int]:
    widths, fan_in = GROUPS[name]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype).to(DEVICE)

    a, b_t = rand(SLOTS, len(widths), MAX_RANK, fan_in), rand(SLOTS, MAX_RANK, sum(widths))
    a[1, :, MAX_RANK // 2 :] = 0
    b_t[1, MAX_RANK // 2 :] = 0
    scales = (torch.rand(SLOTS, len(widths), generator=g) + 0.5).to(DEVICE)
    if len(widths) > 1:
        a[2, 1:] = 0
        b_t[2, :, widths[0] :] = 0
        scales[2, 1:] = 0
    return a, b_t, scales, widths, fan_in


def _slots(rows: int) -> torch.Tensor:
    """Adapters and base rows mixed: row 0 adapted, then -1, 1, 2, -1, 0, 1."""
    pattern = [0, -1, 1, 2, -1, 0, 1]
    return torch.tensor(pattern[:rows], dtype=torch.int64, device=DEVICE)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 2e-2, "atol": 3e-2}


@pytest.mark.parametrize(("rows", "group", "dtype", "config"), CASES)
def test_gemv_with_lora_epilogue_equals_gemv_plus_reference(
    rows: int, group: str, dtype: torch.dtype, config: str
) -> None:
    """`down` runs through `gemv_silu_mul` (the shrink reads the fused activation); odd row
    counts carry a bias. Base rows store exactly the plain GEMV's values."""
    g = torch.Generator().manual_seed(rows * 31 + len(group))
    a, b_t, scales, widths, fan_in = _group(group, dtype, g)
    act = group == "down"
    n = sum(widths)
    x = (torch.randn(rows, (2 if act else 1) * fan_in, generator=g) * 0.5).to(dtype).to(DEVICE)
    w = (torch.randn(n, fan_in, generator=g) * 0.1).to(dtype).to(DEVICE)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype).to(DEVICE) if rows % 2 else None
    token_slots = _slots(rows)
    cfg = CONFIGS[config]
    run = gemv_silu_mul if act else gemv
    plain = run(x, w, bias, config=cfg)
    lora = lora_shrink(x, a, b_t, token_slots, scales, widths, act=act)
    got = run(x, w, bias, config=cfg, lora=lora)

    inp = reference.silu_and_mul(x) if act else x
    want = plain.float().clone()  # (a float32 plain would be the same tensor)
    f32 = [t.float() for t in (inp, a, b_t)]
    lora_reference.lora_gather_add(want, f32[0], f32[1], f32[2], token_slots, scales, widths)
    torch.testing.assert_close(got, want.to(dtype), **_tol(dtype))
    base = token_slots < 0
    assert torch.equal(got[base], plain[base])
    assert not torch.equal(got[~base], plain[~base])
    if rows <= 2:  # every row of the base model (a decode graph's replay without adapters)
        none = torch.full_like(token_slots, -1)
        lora = lora_shrink(x, a, b_t, none, scales, widths, act=act)
        assert torch.equal(run(x, w, bias, config=cfg, lora=lora), plain)


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_lora_linear_equals_reference(rows: int, act: bool) -> None:
    """`KernelOps.lora_linear` on CUDA: at the GEMV's rows the epilogue form (with the
    default `FEW_ROWS_FORM`), beyond them the projection then the gather op; the split form
    forced at GEMV rows gives the same values."""
    g = torch.Generator().manual_seed(100 + rows)
    a, b_t, scales, widths, fan_in = _group("qkv", torch.float32, g)
    n = sum(widths)
    x = (torch.randn(rows, (2 if act else 1) * fan_in, generator=g) * 0.5).to(DEVICE)
    w = (torch.randn(n, fan_in, generator=g) * 0.1).to(DEVICE)
    bias = (torch.randn(n, generator=g) * 0.1).to(DEVICE)
    token_slots = _slots(rows)
    args = (x, w, bias, a, b_t, token_slots, scales, widths)
    want = lora_reference.lora_linear(*args, act=act)
    got = triton_linear.lora_linear(*args, act=act)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    split = triton_linear.lora_linear(*args, act=act, form="split")
    torch.testing.assert_close(got, split, rtol=1e-5, atol=1e-5)
    assert triton_lora.FEW_ROWS_FORM in ("epilogue", "split", "sync", "fused")


def test_epilogue_errors_name_the_problem() -> None:
    g = torch.Generator().manual_seed(5)
    a, b_t, scales, widths, fan_in = _group("qkv", torch.float32, g)
    x = torch.randn(2, fan_in).to(DEVICE)
    with pytest.raises(ValueError, match="one slot per row"):
        lora_shrink(x, a, b_t, _slots(1), scales, widths)
    with pytest.raises(ValueError, match="features"):
        lora_shrink(x, a, b_t, _slots(2), scales, widths, act=True)
    lora = lora_shrink(x, a, b_t, _slots(2), scales, widths)
    w = torch.randn(sum(widths) + 8, fan_in).to(DEVICE)
    with pytest.raises(ValueError, match="columns"):
        gemv(x, w, lora=lora)
    with pytest.raises(ValueError, match="rows"):
        gemv(x[:1], w[: sum(widths)], lora=lora)
