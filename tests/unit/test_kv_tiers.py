"""Issue 19, the prefix cache's lower tiers on their own: chain keys name a block by its whole
prefix and namespace; the host tier spills to disk under LRU; the disk tier survives a
restart, skips foreign files and detects a corrupted block; random traffic keeps every byte
accounted for."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.cache.kv_tiers import KvTiers, chain_keys


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
