"""`PagedKVCache.copy_blocks` (a beam step's copy-on-write copies in one batch) equals the
one-at-a-time `copy_block` on every layer, and refuses mismatched or overlapping lists."""

from __future__ import annotations

import pytest
import torch

from metrale.cache.kv_cache import PagedKVCache


def _cache() -> PagedKVCache:
    cache = PagedKVCache(2, 8, 4, 2, 3, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return cache


def test_copy_blocks_equals_copy_block() -> None:
    batched, single = _cache(), _cache()
    src, dst = [1, 5, 1], [2, 7, 6]
    batched.copy_blocks(src, dst)
    for s, d in zip(src, dst, strict=True):
        single.copy_block(s, d)
    for (bk, bv), (sk, sv) in zip(batched.layers, single.layers, strict=True):
        assert torch.equal(bk, sk) and torch.equal(bv, sv)
    before = [t.clone() for kv in batched.layers for t in kv]
    batched.copy_blocks([], [])
    assert all(torch.equal(a, b) for a, b in zip(before, [t for kv in batched.layers for t in kv]))
    with pytest.raises(ValueError, match="as many"):
        batched.copy_blocks([1, 2], [3])
    with pytest.raises(ValueError, match="also a source"):
        batched.copy_blocks([1, 2], [2, 3])
