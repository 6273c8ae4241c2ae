"""Issue 19, the prefix cache's lower tiers on their own: chain keys name a block by its whole
prefix and namespace; the host tier spills to disk under LRU; the disk tier survives a
restart, skips foreign files and detects a corrupted block; random traffic keeps every byte
accounted for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.cache.kv_tiers import KvTiers, chain_keys


def _random_pool(layers: int, blocks: int):  # type: ignore[no-untyped-def]
    """A float32 CPU KV pool of `layers` x `blocks` (4 tokens, 2 heads of 8) filled with
    normal values, and the constructor of empty ones of the same shape."""
    import torch

    from metrale.cache import kv_cache

    def pool() -> kv_cache.PagedKVCache:
        return kv_cache.PagedKVCache(layers, blocks, 4, 2, 8, torch.float32, torch.device("cpu"))

    src = pool()
    for k, v in src.layers:
        k.normal_()
        v.normal_()
    return src, pool


def test_chain_keys_name_the_whole_prefix_and_namespace() -> None:
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, namespace=0)
    assert len(a) == 2  # full blocks only
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 0) == a
    assert chain_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, 0)[1] != a[1]  # same block, other prefix
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 1) != a  # other namespace
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 2, 0)[1] != a[0]  # other block size


def test_host_spills_to_disk_and_disk_survives_a_restart(tmp_path: Path) -> None:
    blocks = {bytes([i]) * 20: os.urandom(100) for i in range(6)}
    tiers = KvTiers(host_bytes=250, disk_dir=tmp_path, disk_bytes=10_000, fingerprint=b"m1")
    for key, payload in blocks.items():
        tiers.put(key, payload)
    tiers.flush()
    assert tiers.stats.host.blocks == 2 and tiers.stats.disk.blocks == 4
    keys = list(blocks)
    assert tiers.match(keys) == 6
    assert tiers.take(keys[5]) == (blocks[keys[5]], "host")
    assert tiers.take(keys[0]) == (blocks[keys[0]], "disk")
    assert tiers.match(keys) == 0  # taken blocks leave their tier
    tiers.close()

    again = KvTiers(host_bytes=250, disk_dir=tmp_path, disk_bytes=10_000, fingerprint=b"m1")
    assert again.stats.disk.blocks == 3
    assert again.take(keys[1]) == (blocks[keys[1]], "disk")
    # A file whose payload was damaged is detected, deleted and recomputed (a miss).
    victim = tmp_path / (keys[2].hex() + ".kvb")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert again.take(keys[2]) is None and again.stats.corrupt == 1
    assert not victim.exists()
    again.close()

    # Another model's pool never reads these files; a stray file is skipped with a warning.
    (tmp_path / "junk.kvb").write_bytes(b"not a block")
    other = KvTiers(host_bytes=250, disk_dir=tmp_path, disk_bytes=10_000, fingerprint=b"m2")
    assert other.stats.disk.blocks == 0 and other.stats.foreign == 1 and other.stats.corrupt == 1
    assert other.take(keys[3]) is None
    other.close()


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["put", "take"]), st.integers(0, 11),
                           st.integers(1, 90)), max_size=60),
)  # fmt: skip
def test_random_traffic_keeps_every_byte_accounted_for(tmp_path_factory, ops) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("tier")
    tiers = KvTiers(host_bytes=200, disk_dir=directory, disk_bytes=400, fingerprint=b"x")
    live: dict[bytes, bytes] = {}
    for op, k, size in ops:
        key = bytes([k]) * 20
        if op == "put" and not tiers.contains(key):
            payload = bytes([k]) * size
            tiers.put(key, payload)
            live[key] = payload
        elif op == "put":  # evicted again: the new copy replaces any older one
            payload = bytes([k + 1]) * size
            tiers.put(key, payload)
            live[key] = payload
        elif op == "take":
            got = tiers.take(key)
            if got is not None:
                assert got[0] == live.pop(key)
        assert tiers.stats.host.bytes == sum(map(len, tiers.host.items.values())) <= 200
        assert tiers.stats.host.blocks == len(tiers.host.items)
        assert tiers.disk is not None and tiers.stats.disk.bytes == sum(tiers.disk.index.values())
        assert tiers.stats.disk.bytes <= 400
        assert not set(tiers.host.items) & set(tiers.disk.index)  # one tier at a time
    tiers.flush()
    on_disk = {p.name for p in directory.glob("*.kvb")}
    assert on_disk == {k.hex() + ".kvb" for k in tiers.disk.index}
    tiers.close()


def test_take_many_reads_disk_in_parallel_in_chain_order_up_to_a_damaged_block(
    tmp_path: Path,
) -> None:
    blocks = {bytes([i]) * 20: os.urandom(100) for i in range(8)}
    tiers = KvTiers(host_bytes=250, disk_dir=tmp_path, disk_bytes=10_000, fingerprint=b"m1")
    for key, payload in blocks.items():
        tiers.put(key, payload)
    tiers.flush()
    keys = list(blocks)  # 0..5 on disk, 6 and 7 in host memory
    assert tiers.take_many(keys[:2] + keys[6:]) == [
        (blocks[keys[0]], "disk"), (blocks[keys[1]], "disk"),
        (blocks[keys[6]], "host"), (blocks[keys[7]], "host"),
    ]  # fmt: skip
    assert tiers.stats.disk.hits == 2 and tiers.stats.host.hits == 2
    victim = tmp_path / (keys[3].hex() + ".kvb")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    # Block 3 fails its checksum: 2 comes back, 3 is gone, 4 and 5 (read meanwhile) are kept.
    assert tiers.take_many(keys[2:6]) == [(blocks[keys[2]], "disk")]
    assert tiers.stats.corrupt == 1 and not tiers.contains(keys[3])
    assert tiers.take(keys[4]) == (blocks[keys[4]], "host")
    assert tiers.take_many([keys[5], keys[0]]) == [(blocks[keys[5]], "host")]  # 0 was taken
    tiers.close()


def test_many_blocks_written_at_once_equal_one_at_a_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    from metrale.cache import kv_cache

    src, pool = _random_pool(3, 10)
    payloads = [src.block_bytes(b) for b in (1, 2, 3, 4, 5)]
    one, many = pool(), pool()
    for block, payload in zip((9, 3, 7, 2, 5), payloads, strict=True):
        one.write_block_bytes(block, payload)
    size = len(payloads[0])
    monkeypatch.setattr(kv_cache, "_STAGING_BYTES", 2 * size)  # three chunks: 2, 2, 1 blocks
    many.write_blocks_bytes([9, 3, 7, 2, 5], payloads)
    for (k1, v1), (k2, v2) in zip(one.layers, many.layers, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert [many.block_bytes(b) for b in (9, 3, 7, 2, 5)] == payloads
    with pytest.raises(ValueError, match="payload of"):
        many.write_blocks_bytes([1], [payloads[0][:-4]])


def test_host_block_payloads_restore_like_bytes_and_spill_to_disk_as_bytes(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """`block_payload` (the offload path's tensor payload) holds `block_bytes`'s bytes; a
    restore mixing host blocks and bytes (host and disk tiers) writes the same blocks; a host
    block pushed to the disk tier is stored as its bytes."""

    from metrale.cache import kv_cache
    from metrale.cache.kv_tiers import HostBlock, KvTiers, payload_bytes

    src, pool = _random_pool(3, 10)
    blocks = [src.block_payload(b) for b in (1, 2, 3, 4, 5)]
    assert all(isinstance(p, HostBlock) for p in blocks)
    assert [payload_bytes(p) for p in blocks] == [src.block_bytes(b) for b in (1, 2, 3, 4, 5)]
    mixed = [blocks[0], src.block_bytes(2), blocks[2], src.block_bytes(4), blocks[4]]
    size = len(blocks[0])
    monkeypatch.setattr(kv_cache, "_STAGING_BYTES", 2 * size)  # chunks of 2, 2, 1
    dst = pool()
    dst.write_blocks_bytes([9, 3, 7, 2, 5], mixed)
    assert [dst.block_bytes(b) for b in (9, 3, 7, 2, 5)] == [
        src.block_bytes(b) for b in (1, 2, 3, 4, 5)
    ]
    tiers = KvTiers(2 * size, tmp_path, 8 * size, b"fp")
    for i, p in enumerate(blocks):
        tiers.put(bytes([i]) * 20, p)
    tiers.flush()
    assert tiers.stats.host.blocks == 2 and tiers.stats.disk.blocks == 3
    got = tiers.take(bytes([0]) * 20)
    assert got is not None and got == (src.block_bytes(1), "disk")


def test_restore_copies_runs_of_slab_rows_into_the_right_blocks(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Host blocks that are rows of one slab (the CUDA offload's layout) are restored in
    slab order, runs of adjacent rows at once, each into its own target block."""
    import torch

    from metrale.cache.kv_tiers import HostBlock

    src, pool = _random_pool(2, 12)
    size = len(src.block_bytes(1))
    slab = torch.empty((8, size), dtype=torch.uint8)
    rows = [5, 4, 3, 0, 7, 1]  # evicted leaf first: rows run backwards along the prefix
    for b, r in enumerate(rows, start=1):
        slab[r] = torch.frombuffer(bytearray(src.block_bytes(b)), dtype=torch.uint8)
    payloads = [HostBlock(slab[r], slab=slab, row=r) for r in rows]
    payloads[3] = src.block_bytes(4)  # one from the disk tier among them
    copies: list[int] = []
    real = torch.Tensor.copy_

    def counted(self, other, non_blocking=False):  # type: ignore[no-untyped-def]
        copies.append(other.shape[0] if other.dim() == 2 else 1)
        return real(self, other, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    dst = pool()
    dst.write_blocks_bytes([11, 10, 9, 8, 7, 6], payloads)
    monkeypatch.undo()
    assert [dst.block_bytes(b) for b in (11, 10, 9, 8, 7, 6)] == [
        src.block_bytes(b) for b in range(1, 7)
    ]
    assert 3 in copies  # rows 3, 4, 5 in one copy
