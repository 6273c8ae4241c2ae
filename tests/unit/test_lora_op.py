"""The batched LoRA op against a plain per-row loop: rows of several slots, base rows, slots
of different ranks, a slot that does not adapt the target; the routing puts each token row
with its sequence's slot."""

from __future__ import annotations

import torch

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
