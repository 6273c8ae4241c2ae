"""The SSM snapshot store on its own (A.7 #7): over random acquire / publish / release traffic
the slot accounting holds (used = published + private, used + free = slots), private decode
tracks are never evicted and never hold more than half the pool; a full store evicts the
published snapshot of lowest Marconi utility, as a brute-force computation picks it; save and
restore are bit copies; and a radix eviction releases its node's snapshot."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.cache.block_pool import BlockPool
from metrale.cache.radix import RadixNode, RadixPrefixCache
from metrale.cache.ssm_pool import SsmLayerSpec, SsmSlotPool
from metrale.cache.ssm_snapshots import SnapshotCost, SsmSnapshotStore

SPECS = [SsmLayerSpec((6, 4), (2, 3, 5)), SsmLayerSpec((6, 4), (2, 3, 5))]
COST = SnapshotCost(linear=1000.0, attention=3.0)


def store(slots: int, alpha: float = 1.0) -> SsmSnapshotStore:
    return SsmSnapshotStore(SPECS, slots, torch.float32, torch.device("cpu"), COST, alpha)


def chain(depth: int) -> list[RadixNode]:
    """A root and `depth` nodes below it, one per 16-token block."""
    root = RadixNode(block=0, chunk=(), parent=None)
    nodes = [root]
    for i in range(depth):
        node = RadixNode(block=i + 1, chunk=(i,), parent=nodes[-1])
        nodes[-1].children[node.chunk] = node
        nodes.append(node)
    return nodes


ops = st.lists(
    st.tuples(st.sampled_from(["publish", "track", "adopt", "release"]), st.integers(0, 30)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(1, 5))
def test_random_traffic_keeps_the_slot_accounting(
    script: list[tuple[str, int]], slots: int
) -> None:
    s = store(slots)
    nodes = chain(31)[1:]
    tracks = []
    for op, i in script:
        node = nodes[i]
        if op == "publish" and node.snapshot is None:
            snap = s.acquire(16 * (i + 1), "tail", session=i % 3)
            if snap is not None:
                s.publish(snap, node)
        elif op == "track":
            before = set(tracks)
            snap = s.acquire(16 * (i + 1), "decode", session=i % 3, private=True)
            if snap is not None:
                tracks.append(snap)
            assert all(t.guard.idx() is not None for t in before), "a private track was evicted"
        elif op == "adopt" and tracks and node.snapshot is None:
            s.publish(tracks.pop(i % len(tracks)), node)
        elif op == "release":
            if tracks:
                s.release(tracks.pop(i % len(tracks)))
            elif node.snapshot is not None:
                s.release(node.snapshot)
                assert node.snapshot is None
        s.check()
        assert s.num_private() == len(tracks) <= max(1, slots // 2)
    for t in tracks:
        s.release(t)
        s.release(t)  # idempotent
    s.evict_all()
    s.check()
    assert s.num_used() == 0 and s.pool.num_free() == slots


def brute_force_victim(s: SsmSnapshotStore, published: list) -> object:
    """Marconi's utility computed independently: recency and flops-saved-per-byte, min-max
    normalised over the published snapshots; the lowest (oldest on ties) goes."""

    def saved(snap: object) -> float:
        parent = 0
        node = snap.node.parent
        while node is not None:
            if node.snapshot is not None:
                parent = node.snapshot.tokens
                break
            node = node.parent
        return COST.flops(parent, snap.tokens) / s.bytes_per_snapshot

    def norm(xs: list[float]) -> list[float]:
        lo, hi = min(xs), max(xs)
        return [0.0 if hi == lo else (x - lo) / (hi - lo) for x in xs]

    rec = norm([float(p.last_access) for p in published])
    worth = norm([saved(p) for p in published])
    scores = [r + s.alpha * w for r, w in zip(rec, worth, strict=True)]
    best = min(range(len(published)), key=lambda k: (scores[k], published[k].last_access))
    return published[best]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=4, max_size=4, unique=True),
    st.permutations(range(4)),
    st.sampled_from([0.0, 0.5, 2.0]),
)
def test_a_full_store_evicts_the_lowest_marconi_utility(
    depths: list[int], touch_order: list[int], alpha: float
) -> None:
    s = store(4, alpha)
    nodes = chain(31)[1:]
    published = []
    for d in depths:
        snap = s.acquire(16 * (d + 1), "tail", session=0)
        assert snap is not None
        s.publish(snap, nodes[d])
        published.append(snap)
    for k in touch_order:
        s.touch(published[k], session=0)
    expected = brute_force_victim(s, published)
    newcomer = s.acquire(16 * 32, "tail", session=0)  # deepest of all: always worth keeping
    assert newcomer is not None
    assert expected.guard.idx() is None, "evicted another snapshot than the lowest utility"
    assert sum(p.guard.idx() is None for p in published) == 1
    assert s.stats.evictions == 1
    s.release(newcomer)
    s.check()


def test_alpha_zero_is_lru_and_sessions_keep_their_snapshots() -> None:
    s = store(3, alpha=0.0)
    nodes = chain(8)[1:]
    a, b, c = (s.acquire(16 * (i + 1), "tail", session=i + 1) for i in range(3))
    for snap, node in zip((a, b, c), nodes, strict=False):
        s.publish(snap, node)
    s.touch_session(1)  # a's conversation came back: its snapshot is kept
    d = s.acquire(16 * 5, "tail", session=9)
    assert d is not None and a.guard.idx() is not None and b.guard.idx() is None
    assert nodes[1].snapshot is None and nodes[1].snapshot_evicted is False  # no hook set
    s.check()


def test_private_tracks_take_at_most_half_and_are_never_evicted() -> None:
    s = store(4)
    t1 = s.acquire(16, "decode", session=1, private=True)
    t2 = s.acquire(32, "decode", session=1, private=True)
    assert t1 is not None and t2 is not None
    assert s.acquire(48, "decode", session=1, private=True) is None
    nodes = chain(4)[1:]
    for i in (0, 1):
        snap = s.acquire(16 * (i + 1), "tail", session=2)
        assert snap is not None
        s.publish(snap, nodes[i])
    third = s.acquire(64, "tail", session=2)  # full: evicts a published one, not a track
    assert third is not None and t1.guard.idx() is not None and t2.guard.idx() is not None
    assert s.stats.captures_skipped == 1 and s.stats.evictions == 1
    s.check()


def test_save_and_restore_are_bit_copies() -> None:
    live = SsmSlotPool(SPECS, 3, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for conv, ssm in live.layers:
        conv.copy_(torch.randn(conv.shape, generator=g))
        ssm.copy_(torch.randn(ssm.shape, generator=g))
    s = store(2)
    snap = s.acquire(32, "tail", session=0)
    assert snap is not None
    s.save(snap, live, 1, 32)
    s.restore(snap, live, 2)
    assert live.num_tokens[2] == 32
    for conv, ssm in live.layers:
        assert torch.equal(conv[2], conv[1]) and torch.equal(ssm[2], ssm[1])


def test_radix_eviction_releases_the_node_snapshot() -> None:
    pool = BlockPool(8)
    s = store(2)
    cache = RadixPrefixCache(pool, 4, s)
    blocks = pool.allocate(2)
    tokens = list(range(8))
    cache.insert(tokens, blocks, adapter_id=0)
    node = cache.node_at(tokens, 0)
    assert node is not None
    snap = s.acquire(8, "tail", session=0)
    assert snap is not None
    s.publish(snap, node)
    # A 9-token prompt reuses both blocks (the snapshot covers 8 < 9); the same 8 reuse 4.
    assert cache.match([*tokens, 99], 0).reused == 0 + 8
    assert cache.match(tokens, 0).reused == 0  # only a snapshot strictly below the end counts
    pool.decref(blocks)  # the sequence is gone: only the cache holds them
    assert cache.evict(2) == 2
    assert snap.guard.idx() is None and s.num_used() == 0 and s.stats.released_with_kv == 1
    s.check()


def test_session_tags_come_from_session_id_user_or_the_prompt_opening() -> None:
    from metrale.scheduler.sequence import SESSION_PREFIX_TOKENS, session_hash
    from metrale.server.protocol.common import parse_body
    from metrale.server.protocol.openai import ChatCompletionRequest

    prompt = list(range(100))
    turn2 = [*prompt, 7, 8, 9]
    assert session_hash(0, None, prompt) == session_hash(0, None, turn2)  # one conversation
    assert session_hash(0, None, prompt) != session_hash(1, None, prompt)  # namespaces apart
    other = [*prompt[: SESSION_PREFIX_TOKENS - 1], 999, *prompt[SESSION_PREFIX_TOKENS:]]
    assert session_hash(0, None, other) != session_hash(0, None, prompt)
    assert session_hash(0, "s1", prompt) == session_hash(0, "s1", [5]) != session_hash(0, "s2", [5])
    assert all(session_hash(ns, sid, prompt) != 0 for ns in (0, 3) for sid in (None, "x"))
    msgs = [{"role": "user", "content": "hi"}]
    body = parse_body(ChatCompletionRequest, {"messages": msgs, "session_id": "c1", "user": "u"})
    assert body.session() == "c1"
    assert parse_body(ChatCompletionRequest, {"messages": msgs, "user": "u"}).session() == "user:u"
    assert parse_body(ChatCompletionRequest, {"messages": msgs}).session() is None
