"""The batched LoRA op against a plain per-row loop: rows of several slots, base rows, slots
of different ranks, a slot that does not adapt the target; the routing puts each token row
with its sequence's slot."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import lora_reference
from metrale.layers.lora import LoraBatch, LoraSlots


def test_segment_op_equals_a_per_row_loop() -> None:
    g = torch.Generator().manual_seed(0)
    fan_in, fan_out, max_rank = 24, 40, 8
    slots = LoraSlots(
        {(0, "q_proj"): (fan_in, fan_out)}, 3, max_rank, torch.float64, torch.device("cpu")
    )
    weights = {}
    for slot, rank in ((0, 8), (1, 3)):  # slot 2 stays empty (adapts nothing)
        a = torch.randn(rank, fan_in, generator=g, dtype=torch.float64)
        b = torch.randn(fan_out, rank, generator=g, dtype=torch.float64)
        weights[slot] = (a, b, 0.5 + slot)
        slots.write_slot(slot, {(0, "q_proj"): weights[slot]})
    row_slots, query_lens = [1, -1, 0, 2, 1, 0], [1, 1, 5, 2, 4, 3]
    batch = LoraBatch.build(row_slots, query_lens, torch.device("cpu"))
    assert batch is not None
    assert batch.token_slots.tolist() == [
        s for s, n in zip(row_slots, query_lens) for _ in range(n)
    ]
    x = torch.randn(sum(query_lens), fan_in, generator=g, dtype=torch.float64)
    y = torch.randn(sum(query_lens), fan_out, generator=g, dtype=torch.float64)
    expected = y.clone()
    for t, slot in enumerate(batch.token_slots.tolist()):
        if slot in weights:
            a, b, scale = weights[slot]
            expected[t] += (b @ (a @ x[t])) * scale
    slots.batch = batch
    slots.layer(0).add(x, y, [("q_proj", 0, fan_out)])
    torch.testing.assert_close(y, expected)


def test_routing_of_a_base_only_batch_is_none_and_one_slot_needs_no_index() -> None:
    cpu = torch.device("cpu")
    assert LoraBatch.build([-1, -1], [3, 1], cpu) is None
    one = LoraBatch.build([2, 2], [3, 1], cpu)
    assert one is not None and one.groups == [(2, None)]


def test_device_routing_by_gather_equals_the_segment_op() -> None:
    """The capturable routing (slot tensor only, `lora_reference.lora_gather_add`) gives the
    segment op's result, after a slot was rewritten with a lower rank (stale rows zeroed)."""
    g = torch.Generator().manual_seed(3)
    cpu = torch.device("cpu")
    shapes = {(0, "q_proj"): (16, 12), (0, "o_proj"): (12, 16)}
    slots = LoraSlots(shapes, 2, 8, torch.float64, cpu)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    slots.write_slot(0, {(0, "q_proj"): (rand(8, 16), rand(12, 8), 2.0)})
    slots.write_slot(0, {(0, "q_proj"): (rand(2, 16), rand(12, 2), 0.5)})  # rank 8 -> 2
    slots.write_slot(1, {(0, "o_proj"): (rand(5, 12), rand(16, 5), 1.5)})
    row_slots, lens = [0, -1, 1, 0], [2, 1, 3, 1]
    x, y = rand(7, 16), rand(7, 12)
    out = {}
    for name, batch in (
        ("segment", LoraBatch.build(row_slots, lens, cpu)),
        ("gather", LoraBatch(LoraBatch.build(row_slots, lens, cpu).token_slots, None)),
    ):
        slots.batch = batch
        out[name] = y.clone()
        slots.layer(0).add(x, out[name], [("q_proj", 0, 12)])
    torch.testing.assert_close(out["gather"], out["segment"])
    assert not torch.equal(out["segment"], y)


def test_route_gives_eager_forwards_tiles_when_a_tiled_op_is_there() -> None:
    cpu = torch.device("cpu")
    shapes = {(0, "q_proj"): (16, 12)}
    batch = LoraBatch.build([0, -1, 1], [40, 3, 2], cpu)
    assert batch is not None and batch.tiles is not None
    # rows of one slot cut into tiles of at most TILE_ROWS; the base row is in none
    assert batch.tiles.tolist() == [[0, 32, 0], [32, 8, 0], [43, 2, 1]]
    tiled = LoraSlots(shapes, 2, 8, torch.float64, cpu, tiles_op=lora_reference.lora_tiles_add)
    routed = tiled.route(batch)
    assert routed is not None and routed.groups is None and routed.tiles is batch.tiles
    assert tiled.route(None) is None
    assert LoraSlots(shapes, 2, 8, torch.float64, cpu).route(batch) is batch


def test_tiled_op_equals_the_segment_op() -> None:
    """The tiled routing (reference op) adds what the segment op adds, base rows untouched."""
    g = torch.Generator().manual_seed(9)
    cpu = torch.device("cpu")
    shapes = {(0, "gate_proj"): (16, 24), (0, "up_proj"): (16, 24)}
    slots = LoraSlots(shapes, 3, 8, torch.float64, cpu, tiles_op=lora_reference.lora_tiles_add)
    for slot, rank in ((0, 8), (2, 5)):
        slots.write_slot(slot, {
            key: (torch.randn(rank, 16, generator=g, dtype=torch.float64),
                  torch.randn(24, rank, generator=g, dtype=torch.float64), 1.0 + slot)
            for key in shapes
        })  # fmt: skip
    batch = LoraBatch.build([2, -1, 0, 2], [35, 4, 3, 1], cpu)
    x = torch.randn(43, 16, generator=g, dtype=torch.float64)
    y = torch.randn(43, 48, generator=g, dtype=torch.float64)
    targets = [("gate_proj", 0, 24), ("up_proj", 24, 24)]
    out = {}
    for name, routed in (("segment", batch), ("tiles", slots.route(batch))):
        slots.batch = routed
        out[name] = y.clone()
        slots.layer(0).add(x, out[name], targets)
    torch.testing.assert_close(out["tiles"], out["segment"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out["tiles"][35:39], y[35:39])
    assert not torch.equal(out["tiles"], y)


def test_a_group_is_added_in_one_gather_call_and_a_foreign_layout_is_refused() -> None:
    """q/k/v adapted side by side through one gather call equal three per-target segment
    adds; targets passed out of their group's column order are an error, not a wrong add."""
    g = torch.Generator().manual_seed(5)
    cpu = torch.device("cpu")
    shapes = {(0, "q_proj"): (16, 12), (0, "k_proj"): (16, 4), (0, "v_proj"): (16, 4)}
    calls: list[tuple[int, ...]] = []

    def counting_op(*args: object) -> None:
        calls.append(args[-1])  # type: ignore[arg-type]
        lora_reference.lora_gather_add(*args)  # type: ignore[arg-type]

    slots = LoraSlots(shapes, 2, 8, torch.float64, cpu, gather_op=counting_op)
    for slot, rank in ((0, 8), (1, 3)):
        slots.write_slot(slot, {
            key: (torch.randn(rank, 16, generator=g, dtype=torch.float64),
                  torch.randn(out, rank, generator=g, dtype=torch.float64), 0.5 + slot)
            for key, (_, out) in shapes.items() if not (slot == 1 and key[1] == "k_proj")
        })  # fmt: skip
    batch = LoraBatch.build([1, -1, 0], [2, 1, 2], cpu)
    assert batch is not None
    targets = [("q_proj", 0, 12), ("k_proj", 12, 4), ("v_proj", 16, 4)]
    x, y = torch.randn(5, 16, generator=g, dtype=torch.float64), torch.zeros(5, 20)
    y = y.double()
    out = {}
    for name, routed in (("segment", batch), ("gather", LoraBatch(batch.token_slots, None))):
        slots.batch = routed
        out[name] = y.clone()
        slots.layer(0).add(x, out[name], targets)
    # (the gather op keeps x @ A.T in float32)
    torch.testing.assert_close(out["gather"], out["segment"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out["gather"][2], y[2])  # the base row
    assert calls == [(12, 4, 4)]
    slots.batch = LoraBatch(batch.token_slots, None)
    with pytest.raises(ValueError, match="not one group's layout"):
        slots.layer(0).add(x, y, [("k_proj", 0, 4), ("q_proj", 4, 12), ("v_proj", 16, 4)])


def test_device_routing_groups_many_rows_by_slot_and_equals_the_segment_op() -> None:
    """Device routing with a plan op (reference ops): from `plan_min_rows` rows on, the first
    add of a forward groups the rows by slot (once: every later layer reuses the plan) and
    the tiled op through `order` adds what the segment op adds; fewer rows keep the gather."""
    g = torch.Generator().manual_seed(11)
    cpu = torch.device("cpu")
    shapes = {(layer, "gate_proj"): (16, 24) for layer in range(2)}
    gathers: list[int] = []

    def counting_gather(*args: object) -> None:
        gathers.append(1)
        lora_reference.lora_gather_add(*args)  # type: ignore[arg-type]

    slots = LoraSlots(
        shapes, 3, 8, torch.float64, cpu, gather_op=counting_gather,
        tiles_op=lora_reference.lora_tiles_add, plan_op=lora_reference.lora_plan, plan_min_rows=6,
    )  # fmt: skip
    for slot, rank in ((0, 8), (2, 5)):
        slots.write_slot(slot, {
            key: (torch.randn(rank, 16, generator=g, dtype=torch.float64),
                  torch.randn(24, rank, generator=g, dtype=torch.float64), 1.0 + slot)
            for key in shapes
        })  # fmt: skip
    row_slots = [2, -1, 0, 2, 0, 0, 1, 2]  # slot 1 adapts nothing
    batch = LoraBatch.build(row_slots, [1] * 8, cpu)
    assert batch is not None
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    y = torch.randn(8, 24, generator=g, dtype=torch.float64)
    out = {}
    for name, routed in (("segment", batch), ("planned", LoraBatch(batch.token_slots, None))):
        slots.batch = routed
        out[name] = y.clone()
        for layer in range(2):
            slots.layer(layer).add(x, out[name], [("gate_proj", 0, 24)])
    torch.testing.assert_close(out["planned"], out["segment"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out["planned"][1], y[1])  # the base row
    assert slots.planned == 1 and gathers == []
    few = LoraBatch(batch.token_slots[:5], None)
    slots.batch = few
    slots.layer(0).add(x[:5], y[:5].clone(), [("gate_proj", 0, 24)])
    assert few.tiles is None and slots.planned == 1 and gathers == [1]
    with pytest.raises(ValueError, match="plan op needs the tiled op"):
        LoraSlots(shapes, 3, 8, torch.float64, cpu, plan_op=lora_reference.lora_plan)


def test_project_runs_the_linear_op_below_the_plan_and_equals_project_then_add() -> None:
    """`LoraLayer.project` under device routing below the plan, with a linear op (reference
    ops, counted): one call per float projection whose output the group covers (the q/k/v
    group, and the down projection with `act`), the same values as the projection then
    `add`; an FP8 projection, eager (segment) routing and planned rows take the old path."""
    from metrale.kernels import KernelOps
    from metrale.layers.fp8_linear import Fp8Linear

    g = torch.Generator().manual_seed(13)
    cpu, f64 = torch.device("cpu"), torch.float64
    shapes = {
        (0, "q_proj"): (16, 12), (0, "k_proj"): (16, 4), (0, "v_proj"): (16, 4),
        (0, "down_proj"): (10, 16),
    }  # fmt: skip
    calls: list[bool] = []

    def counting_linear(*args: object, act: bool = False, **kw: object) -> torch.Tensor:
        calls.append(act)
        return lora_reference.lora_linear(*args, act=act, **kw)  # type: ignore[arg-type]

    slots = LoraSlots(
        shapes, 2, 8, f64, cpu, tiles_op=lora_reference.lora_tiles_add,
        plan_op=lora_reference.lora_plan, plan_min_rows=4, linear_op=counting_linear,
    )  # fmt: skip
    for slot, rank in ((0, 8), (1, 3)):
        slots.write_slot(slot, {
            key: (torch.randn(rank, fan_in, generator=g, dtype=f64),
                  torch.randn(out, rank, generator=g, dtype=f64), 0.5 + slot)
            for key, (fan_in, out) in shapes.items()
        })  # fmt: skip
    ops = KernelOps()
    qkv, down = torch.nn.Linear(16, 20).double(), torch.nn.Linear(10, 16).double()
    targets = [("q_proj", 0, 12), ("k_proj", 12, 4), ("v_proj", 16, 4)]
    x, h = torch.randn(3, 16, generator=g, dtype=f64), torch.randn(3, 20, generator=g, dtype=f64)
    batch = LoraBatch.build([1, -1, 0], [1, 1, 1], cpu)
    assert batch is not None
    layer = slots.layer(0)
    out = {}
    for name, routed in (("segment", batch), ("device", LoraBatch(batch.token_slots, None))):
        slots.batch = routed
        out[name] = (
            layer.project(ops, qkv, x, targets),
            layer.project(ops, down, h, [("down_proj", 0, 16)], act=True),
        )
    for got, want in zip(out["device"], out["segment"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [False, True] and slots.linear_calls == 2
    fp8 = Fp8Linear(16, 20, None, None, ops, cpu)
    slots.batch = LoraBatch(batch.token_slots, None)
    layer.project(ops, fp8, x, targets)  # an FP8 base: projection, then add
    slots.batch = LoraBatch(torch.tensor([0, 1, 0, -1]), None)  # planned: the tiled op
    layer.project(ops, qkv, torch.cat([x, x[:1]]), targets)
    assert slots.planned == 1 and calls == [False, True]
