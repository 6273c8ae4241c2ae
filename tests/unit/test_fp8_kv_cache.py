"""The float8 KV pool and the reference ops on it (CPU): quantization (scale, saturation,
rounding), reads equal to attention over the dequantized cache, the scale checks, per-layer
calibration, and the byte-level block copies (copy-on-write, tiers, swap) on float8 tensors,
which torch cannot index-copy on the CPU."""

from __future__ import annotations

import pytest
import torch

from metrale.cache.kv_cache import KvLayer, PagedKVCache
from metrale.kernels import reference
from metrale.kernels.metadata import AttentionMetadata

FP8 = torch.float8_e4m3fn


def pool(layers: int = 2, blocks: int = 6) -> PagedKVCache:
    return PagedKVCache(layers, blocks, 4, 2, 8, FP8, torch.device("cpu"))


def test_quantize_scales_saturates_and_rounds_to_nearest_even() -> None:
    scale = torch.tensor([0.5])
    x = torch.tensor([1.0, 300.0, -1e6, 0.0, 200.0, 208.0])  # /0.5: 2, 600 (sat), -2e6 (sat)
    q = reference.quantize_kv(x, FP8, scale)
    assert q.dtype == FP8
    assert q.float().tolist() == [2.0, 448.0, -448.0, 0.0, 384.0, 416.0]  # 400 ties to 384
    assert reference.dequantize_kv(q, torch.float32, scale).tolist()[:2] == [1.0, 224.0]
    # A cache in the model dtype: a plain cast, no scale.
    assert torch.equal(reference.quantize_kv(x, torch.bfloat16, None), x.to(torch.bfloat16))


def test_fp8_reads_equal_attention_over_the_dequantized_cache() -> None:
    g = torch.Generator().manual_seed(0)
    kv = pool(1, 5)
    k_cache, v_cache = kv.layers[0]
    kv.set_scales(torch.tensor([[0.02, 0.01]]))
    k = torch.randn(12, 2, 8, generator=g)
    v = torch.randn(12, 2, 8, generator=g)
    slots = torch.arange(4, 16)  # blocks 1..3
    reference.write_kv(k, v, k_cache, v_cache, slots, *kv.layers[0].scale_kwargs().values())
    meta = AttentionMetadata(
        positions=torch.tensor([11, 4, 5]), slot_mapping=torch.tensor([15, 8, 9]),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([12, 6], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2, 3], [1, 2, 0]], dtype=torch.int32), num_decode=1,
        query_lens_host=[1, 2], seq_lens_host=[12, 6], max_query_len=2, max_seq_len=12,
        query_start_loc_host=[0, 1, 3],
    )  # fmt: skip
    q = torch.randn(3, 4, 8, generator=g)
    out = reference.paged_attention(q, k_cache, v_cache, meta, 0.35, **kv.layers[0].scale_kwargs())
    deq_k = reference.dequantize_kv(k_cache, torch.float32, kv.layers[0].k_scale)
    deq_v = reference.dequantize_kv(v_cache, torch.float32, kv.layers[0].v_scale)
    assert torch.equal(out, reference.paged_attention(q, deq_k, deq_v, meta, 0.35))
    err = (deq_k.view(-1, 2, 8)[slots] - k).abs() / k.abs().clamp_min(0.05)
    assert float(err.max()) <= 2**-4 + 1e-6  # E4M3: 3 mantissa bits, round to nearest
    with pytest.raises(ValueError, match="needs its k_scale"):
        reference.paged_attention(q, k_cache, v_cache, meta, 0.35)
    with pytest.raises(ValueError, match="needs its k_scale"):
        reference.write_kv(k, v, k_cache, v_cache, slots)


def test_each_layer_calibrates_once_on_its_first_write() -> None:
    kv = pool()
    assert kv.scales_source == "unset" and isinstance(kv.layers[0], KvLayer)
    kv.arm_calibration()
    assert kv.calibration_pending and kv.scales_source == "calibrating"
    layer0, layer1 = kv.layers
    layer0.calibrate(torch.full((3, 2, 8), -4.48), torch.zeros(3, 2, 8))
    assert layer0.k_scale.item() == pytest.approx(0.01) and layer0.v_scale.item() == 1.0
    assert kv.scales_source == "calibrating"  # layer 1 has not written yet
    layer1.calibrate(torch.ones(1, 2, 8), torch.ones(1, 2, 8) * 896)
    assert kv.scales_source == "calibrated" and layer1.v_scale.item() == 2.0
    layer1.calibrate(torch.ones(1, 2, 8) * 100, torch.ones(1, 2, 8))  # fixed from now on
    assert layer1.k_scale.item() == pytest.approx(1 / 448)
    assert torch.equal(kv.scales[1], torch.stack([layer1.k_scale, layer1.v_scale]).view(2))
    with pytest.raises(ValueError, match="finite and > 0"):
        kv.set_scales(torch.zeros(2, 2))
    model_dtype = PagedKVCache(1, 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert model_dtype.layers[0].scale_kwargs() == {} and model_dtype.scales_source == "none"


def test_block_copies_move_float8_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    kv = pool()
    for k, v in kv.layers:
        k.copy_(torch.randn(k.shape, generator=g).to(FP8))
        v.copy_(torch.randn(v.shape, generator=g).to(FP8))

    def raw(block: int) -> list[torch.Tensor]:
        return [t[block].view(torch.uint8).clone() for layer in kv.layers for t in layer]

    before = {b: raw(b) for b in range(6)}
    kv.copy_blocks([1, 2], [4, 5])  # copy-on-write, batched
    assert all(torch.equal(a, b) for a, b in zip(raw(4), before[1], strict=True))
    payload = kv.block_bytes(2)  # a tier's payload
    kv.write_blocks_bytes([3], [payload])
    assert all(torch.equal(a, b) for a, b in zip(raw(3), before[2], strict=True))
    host = kv.read_blocks([1, 2])  # swap-out: bytes on the host
    assert host[0][0].dtype == torch.uint8
    kv.write_blocks([5, 4], host)
    assert all(torch.equal(a, b) for a, b in zip(raw(5), before[1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(raw(4), before[2], strict=True))
