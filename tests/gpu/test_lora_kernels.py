"""Multi-LoRA on CUDA: the Triton gather op (`triton_lora.lora_gather_add`, split and fused
forms), the tiled op (host tiles, and device-planned tiles through `order`) and the device
plan (`lora_plan`) equal the torch references, and decode graphs captured with the LoRA slots
give every row its adapter's greedy tokens in a batch that mixes adapters and the base model
(against the eager CPU path), with the rows gathered per row or grouped by slot.

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1` (the runner's body then runs uncaptured).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from metrale import LLM, LoRARequest, SamplingParams
from metrale.kernels import lora_reference, triton_lora, triton_lora_tiles
from metrale.kernels.lora_reference import LORA_PLAN_ROWS as PLAN_ROWS
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.lora import ADAPTER_A, ADAPTER_B, build_adapter
from tests.helpers.parity import mixed_prompts

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]


@pytest.mark.parametrize("form", ["split", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rank", "widths", "fan_in"), [(8, (300,), 200), (64, (160, 72, 72), 700)])
def test_triton_gather_op_equals_reference(
    form: str, dtype: torch.dtype, rank: int, widths: tuple[int, ...], fan_in: int
) -> None:
    """One target, and a q/k/v-like group of three (column blocks straddle the targets'
    borders, the input spans several K splits; the fused form's programs each expand
    several column blocks)."""
    g = torch.Generator().manual_seed(rank)
    slots, tokens, fan_out = 3, 7, sum(widths)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype).to(DEVICE)

    a, b_t = rand(slots, len(widths), rank, fan_in), rand(slots, rank, fan_out)
    a[1, :, rank // 2 :] = 0  # a lower-rank adapter: rows past its rank are zero
    b_t[1, rank // 2 :] = 0
    scales = torch.rand(slots, len(widths), generator=g).to(DEVICE) + 0.5
    token_slots = torch.tensor([2, -1, 0, 1, 1, -1, 2], device=DEVICE)
    x = rand(tokens, fan_in)
    wide = rand(tokens, fan_out + 40)
    want, got = wide.clone(), wide.clone()
    # The reference in float32 from the same inputs: the kernel keeps `x @ A.T` in float32,
    # where the torch op rounds it to the weights' dtype before the expand.
    want = want.float()
    f32 = [t.float() for t in (x, a, b_t)]
    lora_reference.lora_gather_add(want[:, 20 : 20 + fan_out], f32[0], f32[1], f32[2], token_slots,
                              scales, widths)  # fmt: skip
    want = want.to(dtype)
    triton_lora.lora_gather_add(
        got[:, 20 : 20 + fan_out], x, a, b_t, token_slots, scales, widths, form=form,
        fused_programs=1,
    )  # fmt: skip
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got, want, **tol)
    untouched = token_slots.cpu() < 0
    assert torch.equal(got[untouched.to(DEVICE)], wide[untouched.to(DEVICE)])
    assert not torch.equal(got, wide)


@pytest.mark.skipif(INTERPRET, reason="the sync form's grid barrier needs resident programs")
@pytest.mark.parametrize("rows", [1, 2])
def test_triton_sync_form_equals_reference_and_leaves_its_counters_zero(rows: int) -> None:
    """The one-launch sync form (K splits, grid barrier, column blocks) on a q/k/v-like group
    of rank 64, eagerly twice and as a CUDA graph replayed twice: each call adds the reference
    delta, and the counters are back to zero (no timeout flagged) after every call."""
    g = torch.Generator().manual_seed(17)
    widths, fan_in, rank, slots = (1024, 256, 256), 3000, 64, 3
    fan_out = sum(widths)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(DEVICE)

    a, b_t = rand(slots, 3, rank, fan_in), rand(slots, rank, fan_out)
    scales = torch.rand(slots, 3, generator=g).to(DEVICE) + 0.5
    token_slots = torch.tensor([2, -1][:rows], device=DEVICE)
    x, y0 = rand(rows, fan_in), rand(rows, fan_out)
    delta = torch.zeros(rows, fan_out, device=DEVICE)
    lora_reference.lora_gather_add(delta, x, a, b_t, token_slots, scales, widths)
    sync = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    y = y0.clone()

    def call() -> None:
        triton_lora.lora_gather_add(
            y, x, a, b_t, token_slots, scales, widths, form="sync", sync=sync
        )

    for n in (1, 2):
        call()
        torch.testing.assert_close(y, y0 + n * delta, rtol=1e-4, atol=1e-4)
        assert sync.tolist() == [0, 0, 0, 0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    y.copy_(y0)
    for n in (1, 2):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, y0 + n * delta, rtol=1e-4, atol=1e-4)
        assert sync.tolist() == [0, 0, 0, 0]
    if rows == 2:
        assert torch.equal(y[1], y0[1])  # the base row
    with pytest.raises(ValueError, match="int32 counters"):
        triton_lora.lora_gather_add(y, x, a, b_t, token_slots, scales, widths, form="sync")


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rank", "widths", "fan_in"), [(8, (300,), 200), (64, (160, 72, 72), 700)])
def test_triton_tiles_op_equals_reference(
    planned: bool, dtype: torch.dtype, rank: int, widths: tuple[int, ...], fan_in: int
) -> None:
    """Tiles of full and partial length, of three slots, and base rows in no tile: routed on
    the host (contiguous rows), or planned on the device (rows grouped by slot through
    `order`, with empty padding tiles)."""
    from metrale.layers.lora import LoraBatch

    g = torch.Generator().manual_seed(rank + 1)
    slots, fan_out = 3, sum(widths)
    row_slots, lens = [2, -1, 0, 1, 2], [40, 5, 3, 1, 33]
    tokens = sum(lens)
    order = None

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype).to(DEVICE)

    a, b_t = rand(slots, len(widths), rank, fan_in), rand(slots, rank, fan_out)
    scales = torch.rand(slots, len(widths), generator=g).to(DEVICE) + 0.5
    batch = LoraBatch.build(row_slots, lens, DEVICE)
    assert batch is not None and batch.tiles is not None
    tiles = batch.tiles
    if planned:  # the rows interleaved, so a slot's rows are not contiguous
        perm = torch.randperm(tokens, generator=g).to(DEVICE)
        batch.token_slots = batch.token_slots[perm]
        order, tiles = triton_lora_tiles.lora_plan(batch.token_slots, slots, PLAN_ROWS)
        assert int((tiles[:, 1] == 0).sum()) > 0  # padding tiles, read and written by none
    x = rand(tokens, fan_in)
    wide = rand(tokens, fan_out + 40)
    want, got = wide.clone().float(), wide.clone()
    f32 = [t.float() for t in (x, a, b_t)]
    lora_reference.lora_gather_add(want[:, 20 : 20 + fan_out], f32[0], f32[1], f32[2],
                                   batch.token_slots, scales, widths)  # fmt: skip
    triton_lora_tiles.lora_tiles_add(
        got[:, 20 : 20 + fan_out], x, a, b_t, tiles, scales, widths, order=order
    )
    # bf16: the kernel rounds `x @ A.T` to bf16 before the expand, the float32 reference does not
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got, want.to(dtype), **tol)
    base = batch.token_slots < 0
    assert torch.equal(got[base], wide[base])
    assert not torch.equal(got, wide)


@pytest.mark.parametrize(
    "token_slots",
    [
        [2, -1, 0, 1, 1, -1, 2, 0, 0, 0],  # one slot's rows span two tiles of 4
        [-1, -1, -1],  # base rows only: no tiles
        [3],
        [(7 * t) % 9 - 1 for t in range(300)],  # several row chunks of the kernel
    ],
)
def test_triton_plan_equals_reference(token_slots: list[int]) -> None:
    """The device plan equals the torch plan; and the plan itself is right: every adapted row
    in exactly one tile, each tile's rows of its slot and at most `block_m` of them, rows in
    slot order, base rows last, padding tiles empty."""
    block_m, num_slots = 4, 8
    slots_t = torch.tensor(token_slots, dtype=torch.int64, device=DEVICE)
    order, tiles = triton_lora_tiles.lora_plan(slots_t, num_slots, block_m)
    want_order, want_tiles = lora_reference.lora_plan(slots_t, num_slots, block_m)
    assert torch.equal(order, want_order) and torch.equal(tiles, want_tiles)
    order_l, tiles_l = order.tolist(), tiles.tolist()
    assert sorted(order_l) == list(range(len(token_slots)))
    keys = [(s if s >= 0 else num_slots) for s in (token_slots[i] for i in order_l)]
    assert keys == sorted(keys)
    covered: list[int] = []
    for first, count, slot in tiles_l:
        assert 0 <= count <= block_m
        rows = order_l[first : first + count]
        assert all(token_slots[r] == slot for r in rows)
        covered += rows
    assert sorted(covered) == [t for t, s in enumerate(token_slots) if s >= 0]
    assert len(tiles_l) == lora_reference.lora_plan_max_tiles(len(token_slots), num_slots, block_m)


@pytest.mark.parametrize("routing", ["gather", "grouped", "few"])
def test_lora_decode_graphs_give_each_row_its_adapter(routing: str) -> None:
    """`grouped`: the graphs group the rows by slot on the device (`LoraSlots.plan`, forced
    from one row on) and run the tiled op; `gather`: the per-row gather op (split form, five
    rows, cuBLAS projections); `few`: two rows, the GEMV's rows: each projection and its
    deltas in one op (`KernelOps.lora_linear`, the few-rows form `triton_lora.FEW_ROWS_FORM`:
    by default the expand in the GEMV's stores)."""
    grouped = routing == "grouped"
    variant = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
    base = build(variant)
    lr_a = LoRARequest(ADAPTER_A.name, 1, str(build_adapter(base, ADAPTER_A)))
    lr_b = LoRARequest(ADAPTER_B.name, 2, str(build_adapter(base, ADAPTER_B)))
    ref = LLM(str(base), device="cpu", num_kv_blocks=300, max_num_seqs=8, enable_lora=True)
    llm = LLM(str(base), device=str(DEVICE), dtype="float32", num_kv_blocks=300, max_num_seqs=8,
              enforce_eager=True, enable_lora=True, max_loras=2)  # fmt: skip
    model = llm.engine.model
    assert model.lora is not None
    if INTERPRET:
        from metrale.kernels.triton_ops import triton_kernel_ops

        ops = triton_kernel_ops()
        for module in model.module.modules():
            if hasattr(module, "ops"):
                module.ops = ops
        model.lora.slots.gather_op = ops.lora_gather_add
        model.lora.slots.tiles_op = ops.lora_tiles_add
        model.lora.slots.plan_op = ops.lora_plan
        model.lora.slots.linear_op = ops.lora_linear
    assert model.lora.slots.tiles_op is not None  # the prefill runs the tiled kernels
    assert model.lora.slots.plan_op is not None
    model.lora.slots.plan_min_rows = 1 if grouped else 10**9
    runner = DecodeGraphRunner(
        model.module, model.kv_cache.layers, model.device, 8, 32, 16, lora=model.lora.slots
    )
    if not INTERPRET:
        runner.capture()
    model.graph_runner = runner
    eager_before = model.eager_forwards  # start-up shape warm-up forwards (CUDA) count too
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    prompts = mixed_prompts(5)
    adapters = [lr_a, None, lr_b, lr_b, lr_a]
    if routing == "few":
        prompts, adapters = prompts[:2], [lr_b, lr_a]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=adapters)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, lora_request=adapters)]
    assert got == want
    assert model.lora_eager_forwards == 0
    assert model.eager_forwards - eager_before == 1, "only the prefill should run eagerly"
    assert (model.lora.slots.planned > 0) == grouped
    assert (model.lora.slots.linear_calls > 0) == (not grouped)
