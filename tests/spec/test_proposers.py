"""The speculative config parser and the two host-side draft proposers (n-gram prompt lookup,
tenant-partitioned suffix lookup): CPU only, pure Python, a few seconds."""

from __future__ import annotations

import json
import random

import pytest

from metrale.errors import InvalidRequestError
from metrale.spec import ngram
from metrale.spec.config import SpeculativeConfig
from metrale.spec.ngram import MAX_HOLD, NgramProposer
from metrale.spec.proposer import DraftRequest
from metrale.spec.suffix import SuffixProposer

# ---------------------------------------------------------------------------- helpers


def req(seq_id: str, tokens: list[int], max_drafts: int = 4, tenant: str | None = None):
    return DraftRequest(seq_id, list(tokens), len(tokens), max_drafts, tenant)


def one(p, seq_id, tokens, max_drafts=4, tenant=None) -> list[int]:
    return p.propose([req(seq_id, tokens, max_drafts, tenant)])[0]


def naive_lookup(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """The definition, by brute force: the longest suffix n-gram with an earlier occurrence
    ending at least n before the end; copy from its latest such occurrence."""
    length = len(tokens)
    for n in range(min(max_n, length // 2), min_n - 1, -1):
        suffix = tokens[length - n :]
        for e in range(length - n, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return tokens[e : min(e + limit, length)]
    return []


def is_true_continuation(source: list[int], query: list[int], draft: list[int], min_n: int) -> bool:
    """Whether `draft` follows, somewhere in `source`, an occurrence of a suffix of `query` of
    length >= min_n."""
    for n in range(min_n, len(query) + 1):
        suffix = query[len(query) - n :]
        for e in range(n, len(source) - len(draft) + 1):
            if source[e - n : e] == suffix and source[e : e + len(draft)] == draft:
                return True
    return False


def drain_hold(p, seq_id: str) -> None:
    for _ in range(MAX_HOLD + 1):
        if p.may_propose(seq_id):
            return
    raise AssertionError("hold longer than MAX_HOLD")


@pytest.fixture
def colliding_hash(monkeypatch):
    """Every n-gram hashes the same: the index keeps one entry per n (per tenant)."""
    monkeypatch.setattr(ngram, "window_hash", lambda prefix, start, end: 0)


# ---------------------------------------------------------------------------- config


def test_config_defaults_describe_and_proposer():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
    assert c.suffix_cache_max_tokens == 262_144
    assert (c.gate, c.gate_window, c.gate_probe_tokens) == ("auto", 16, 256)
    assert c.describe().startswith("ngram k=4 n=2..5")
    p = c.make_proposer()
    assert type(p) is NgramProposer and p.name == "ngram" and p.k == 4

    s = SpeculativeConfig.from_json(
        json.dumps(
            {
                "method": "suffix",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 7,
                "suffix_cache_max_tokens": 1000,
                "gate": "off",
                "gate_window": 8,
                "gate_probe_tokens": 64,
            }
        )
    )
    assert s.describe() == "suffix k=3 n=1..7 cache=1000 gate=off"
    sp = s.make_proposer()
    assert type(sp) is SuffixProposer and sp.name == "suffix"
    assert (sp.k, sp.min_n, sp.max_n, sp.max_tokens) == (3, 1, 7, 1000)


def test_config_min_alone_above_default_max_moves_max():
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)


BASE = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize(
    ("changes", "key", "hint"),
    [
        ({"method": None}, "method", "required"),
        ({"num_speculative_tokens": None}, "num_speculative_tokens", "required"),
        ({"method": "eagle"}, "method", "'ngram', 'suffix'"),
        ({"method": 1}, "method", "'ngram', 'suffix'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens", "1..16"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens", "1..16"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens", "1..16"),
        ({"num_speculative_tokens": "4"}, "num_speculative_tokens", "1..16"),
        ({"num_speculative_tokens": 4.0}, "num_speculative_tokens", "1..16"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min", "1..32"),
        ({"prompt_lookup_min": False}, "prompt_lookup_min", "1..32"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_max", "4..32"),
        ({"prompt_lookup_max": 33}, "prompt_lookup_max", "32"),
        ({"prompt_lookup_max": None}, "prompt_lookup_max", "integer"),
        ({"suffix_cache_max_tokens": 0}, "suffix_cache_max_tokens", ">= 1"),
        ({"suffix_cache_max_tokens": True}, "suffix_cache_max_tokens", ">= 1"),
        ({"gate": "on"}, "gate", "'auto', 'off'"),
        ({"gate": False}, "gate", "'auto', 'off'"),
        ({"gate_window": 0}, "gate_window", ">= 1"),
        ({"gate_window": 1.5}, "gate_window", ">= 1"),
        ({"gate_probe_tokens": -3}, "gate_probe_tokens", ">= 1"),
        ({"draft_model": "x"}, "draft_model", "allowed keys"),
    ],
)
def test_config_errors_name_the_key(changes, key, hint):
    d = dict(BASE)
    for k, v in changes.items():
        if v is None and k in ("method", "num_speculative_tokens"):
            d.pop(k)
        else:
            d[k] = v
    with pytest.raises(InvalidRequestError) as info:
        SpeculativeConfig.from_dict(d)
    err = info.value
    assert err.param == f"speculative_config.{key}"
    assert f"speculative_config.{key}" in err.message
    assert hint in err.message
    # The JSON path reports the same error.
    with pytest.raises(InvalidRequestError) as info2:
        SpeculativeConfig.from_json(json.dumps(d))
    assert info2.value.param == err.param


def test_config_rejects_non_objects_and_bad_json():
    for text in ("[1, 2]", "4", "{not json", ""):
        with pytest.raises(InvalidRequestError) as info:
            SpeculativeConfig.from_json(text)
        assert info.value.param == "speculative_config"
        assert "speculative_config" in info.value.message


def test_config_built_in_code_is_checked_too():
    with pytest.raises(InvalidRequestError) as info:
        SpeculativeConfig(method="ngram", num_speculative_tokens=99)
    assert info.value.param == "speculative_config.num_speculative_tokens"


# ---------------------------------------------------------------------------- ngram


def test_ngram_prefers_longest_match_over_more_recent_shorter_one():
    tokens = [1, 2, 3, 10, 11, 5, 2, 3, 20, 21, 1, 2, 3]
    p = NgramProposer(4, 2, 5)
    # [1, 2, 3] occurred at 0..2; the shorter [2, 3] also at 6..7 (more recent).
    assert one(p, "s", tokens) == [10, 11, 5, 2]
    q = NgramProposer(4, 2, 2)  # with n = 2 only, the most recent [2, 3] wins
    assert one(q, "s", tokens) == [20, 21, 1, 2]


def test_ngram_respects_max_drafts_and_end_of_tokens():
    tokens = [1, 2, 3, 10, 11, 5, 2, 3, 20, 21, 1, 2, 3]
    assert one(NgramProposer(4), "s", tokens, max_drafts=2) == [10, 11]
    assert one(NgramProposer(4), "s", tokens, max_drafts=1) == [10]
    # The occurrence ends at 2; only 3 tokens are known after it, k = 8 or not.
    assert one(NgramProposer(8), "s", [1, 2, 9, 1, 2], max_drafts=8) == [9, 1, 2]


def test_ngram_no_match_and_no_overlap_with_the_suffix():
    p = NgramProposer(4, 2, 5)
    assert one(p, "a", [1, 2, 3, 4, 5, 6]) == []
    assert one(p, "b", [7, 7, 7]) == []  # [7, 7] occurs at 1..2 only by overlapping itself
    assert one(p, "c", [5, 5, 5, 5]) == [5, 5]  # ...but at 0..1 it does not
    assert one(p, "d", [1]) == []
    assert one(p, "e", []) == []


def test_ngram_backoff_doubles_up_to_the_cap_and_a_hit_resets_it():
    p = NgramProposer(4, 2, 3)
    rng = random.Random(0)
    tokens = [1000 + i for i in range(5)]  # all distinct: every round misses
    holds = []
    for _ in range(10):
        assert p.may_propose("s")
        assert one(p, "s", tokens) == []
        held = 0
        while not p.may_propose("s"):
            held += 1
        holds.append(held)
        tokens.append(2000 + rng.randrange(10**6))
    assert holds == [1, 2, 4, 8, 16, 32, 64, 64, 64, 64]
    # A propose request that arrives while held gets nothing and spends a round.
    tokens.append(99)
    assert one(p, "s", tokens) == []  # miss: hold 64
    assert one(p, "s", [*tokens, 1000, 1001]) == []  # held, although it would match
    held = 0
    while not p.may_propose("s"):
        held += 1
    assert held == 63
    # A hit resets the run of misses: the next miss holds one round only.
    tokens += [1000, 1001]
    assert one(p, "s", tokens) == [1002, 1003, 1004, tokens[5]]
    tokens.append(5555)
    assert one(p, "s", tokens) == []
    assert not p.may_propose("s")
    assert p.may_propose("s")
    assert p.stats()["misses"] == 12 and p.stats()["own_hits"] == 1


def test_ngram_window_halves_on_poor_verifies_and_doubles_on_full_ones():
    tokens = list(range(10)) * 2 + [0, 1]  # lots to copy
    p = NgramProposer(4)
    assert len(one(p, "s", tokens)) == 4
    p.on_verified("s", 4, 4)  # full: stays at the cap k
    assert len(one(p, "s", tokens)) == 4
    p.on_verified("s", 4, 1)  # fewer than half: 2
    assert len(one(p, "s", tokens)) == 2
    p.on_verified("s", 2, 1)  # exactly half: unchanged
    assert len(one(p, "s", tokens)) == 2
    p.on_verified("s", 2, 0)  # 1
    assert len(one(p, "s", tokens)) == 1
    p.on_verified("s", 1, 0)  # never below 1
    assert len(one(p, "s", tokens)) == 1
    p.on_verified("s", 1, 1)  # doubles
    assert len(one(p, "s", tokens)) == 2
    p.on_verified("s", 2, 2)
    assert len(one(p, "s", tokens)) == 4
    assert len(one(p, "s", tokens, max_drafts=3)) == 3  # the row's budget still caps it
    p.on_verified("other", 4, 0)  # unknown sequence: ignored


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 3), (2, 5), (3, 3)])
def test_ngram_incremental_growth_equals_fresh_scan(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(6):
        vocab = rng.choice([2, 3, 5])
        tokens: list[int] = []
        inc = NgramProposer(5, min_n, max_n)
        sid = f"s{trial}"
        while len(tokens) < 120:
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            drain_hold(inc, sid)
            got = one(inc, sid, tokens, max_drafts=5)
            assert got == one(NgramProposer(5, min_n, max_n), "fresh", tokens, max_drafts=5)
            assert got == naive_lookup(tokens, min_n, max_n, 5)


def test_ngram_reused_seq_id_with_other_tokens_is_reindexed():
    p = NgramProposer(4, 2, 4)
    assert one(p, "s", [1, 2, 3, 1, 2]) == [3, 1, 2]
    other = [9, 8, 7, 6, 9, 8]  # same seq_id, not an extension of the first
    assert one(p, "s", other) == naive_lookup(other, 2, 4, 4) == [7, 6, 9, 8]
    shorter = [5, 4, 5, 4]
    assert one(p, "s", shorter) == naive_lookup(shorter, 2, 4, 4) == [5, 4]


def test_ngram_placeholder_token_gets_no_drafts_and_is_not_a_miss():
    p = NgramProposer(4)
    tokens = [1, 2, 3, 1, 2, -1]
    assert one(p, "s", tokens) == []
    assert p.may_propose("s")
    tokens[-1] = 3
    assert one(p, "s", tokens) == [1, 2, 3]


def test_ngram_on_finished_drops_state():
    p = NgramProposer(4)
    one(p, "a", [1, 2, 3])
    one(p, "b", [1, 2, 1, 2])
    assert p.stats()["sequences"] == 2
    p.on_finished("a", [1, 2, 3], None)
    p.on_finished("b", [1, 2, 1, 2], "t")
    p.on_finished("never-seen", [], None)
    assert p.stats()["sequences"] == 0
    assert p.may_propose("a")


def test_ngram_hash_collisions_never_give_wrong_drafts(colliding_hash):
    rng = random.Random(7)
    hits = 0
    for trial in range(8):
        p = NgramProposer(4, 1, 4)
        tokens: list[int] = []
        while len(tokens) < 80:
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
            drain_hold(p, "s")
            got = one(p, "s", tokens)
            if got:
                hits += 1
                # A real copy of a non-overlapping earlier occurrence of the suffix.
                assert any(
                    tokens[e - n : e] == tokens[len(tokens) - n :]
                    and e <= len(tokens) - n
                    and tokens[e : e + len(got)] == got
                    for n in range(1, 5)
                    for e in range(n, len(tokens) + 1)
                ), (trial, tokens, got)
    assert hits > 20  # the latest entry per n still matches often


# ---------------------------------------------------------------------------- suffix


def test_suffix_second_request_of_a_tenant_gets_the_first_ones_continuation():
    p = SuffixProposer(4, 2, 5)
    first = [50, 51, 1, 2, 3, 60, 61, 62, 63]
    p.on_finished("a", first, "t")
    assert one(p, "b", [70, 71, 2, 3], tenant="t") == [60, 61, 62, 63]
    assert one(p, "b2", [70, 71, 1, 2, 3], tenant="t", max_drafts=2) == [60, 61]
    st = p.stats()
    assert st["documents"] == 1 and st["stored_tokens"] == len(first)
    assert st["shared_hits"] == 2 and st["own_hits"] == 0
    # Own tokens first: a sequence with its own match copies its own continuation.
    assert one(p, "c", [2, 3, 90, 91, 2, 3], tenant="t") == [90, 91, 2, 3]
    assert p.stats()["own_hits"] == 1


def test_suffix_running_sequences_feed_incrementally():
    p = SuffixProposer(4, 2, 3)
    running = [40, 41, 42]
    p.observe("a", running, "t")
    assert p.stats()["stored_tokens"] == 3
    running += [43, 44, 45]
    p.observe("a", running, "t")
    p.observe("a", running, "t")  # nothing new: nothing stored twice
    assert p.stats()["stored_tokens"] == 6
    assert p.stats()["documents"] == 1
    assert one(p, "b", [1, 41, 42], tenant="t") == [43, 44, 45]
    # Finishing it adds only the tail to the same document.
    p.on_finished("a", [*running, 46], "t")
    assert p.stats()["documents"] == 1 and p.stats()["stored_tokens"] == 7
    assert one(p, "c", [2, 44, 45], tenant="t") == [46]


def test_suffix_tenant_isolation_with_colliding_ngrams():
    """Tenant A's continuations use ids only A ever has; B shares A's n-grams (and, in the
    collision variant below, every hash) but must only see its own tenant's tokens."""
    _isolation_trials(random.Random(3))


def test_suffix_tenant_isolation_under_constant_hash(colliding_hash):
    _isolation_trials(random.Random(4))


def _isolation_trials(rng: random.Random) -> None:
    p = SuffixProposer(4, 1, 4, suffix_cache_max_tokens=400)
    shared = list(range(8))  # ids both tenants use
    b_seen: set[int] = set()
    b_hits = 0
    for i in range(60):
        a_tokens = [rng.choice(shared) if rng.random() < 0.6 else 1000 + rng.randrange(50)]
        for _ in range(rng.randint(5, 25)):
            a_tokens.append(rng.choice(shared) if rng.random() < 0.6 else 1000 + rng.randrange(50))
        b_tokens = [rng.choice(shared) if rng.random() < 0.7 else 500 + rng.randrange(20)]
        for _ in range(rng.randint(5, 25)):
            b_tokens.append(rng.choice(shared) if rng.random() < 0.7 else 500 + rng.randrange(20))
        # Interleave: A running and finished, B running and finished.
        p.observe(f"a{i}", a_tokens[:5], "A")
        p.observe(f"b{i}", b_tokens[:5], "B")
        b_seen.update(b_tokens[:5])
        p.on_finished(f"a{i}", a_tokens, "A")
        p.on_finished(f"b{i}", b_tokens, "B")
        b_seen.update(b_tokens)
        for j in range(5):
            query = [rng.choice(shared) for _ in range(rng.randint(1, 6))]
            sid = f"q{i}.{j}"
            got = one(p, sid, query, tenant="B")
            p.on_finished(sid, query, None)
            b_hits += bool(got)
            assert all(t in b_seen or t in query for t in got), (query, got)
            assert all(t < 1000 for t in got)
    assert b_hits > 50  # the shared index does serve B
    assert p.stats()["evicted_documents"] > 0  # and eviction ran meanwhile


def test_suffix_none_tenant_neither_feeds_nor_reads():
    p = SuffixProposer(4, 2, 4)
    p.on_finished("a", [1, 2, 3, 1001, 1002], "A")
    p.observe("n", [7, 1, 2, 3, 1003], None)
    p.on_finished("n", [7, 1, 2, 3, 1003, 1004], None)
    assert p.stats()["documents"] == 1 and p.stats()["stored_tokens"] == 5
    assert one(p, "q", [9, 2, 3], tenant=None) == []
    assert one(p, "q2", [9, 2, 3], tenant="A") == [1001, 1002]
    assert one(p, "q3", [9, 2, 3], tenant="B") == []


def test_suffix_lru_eviction_stays_in_budget_and_evicted_content_is_gone():
    budget = 20
    p = SuffixProposer(4, 2, 2, suffix_cache_max_tokens=budget)

    def doc(marker: int) -> list[int]:
        return [marker, marker + 1, 7, 8, marker + 2, marker + 3, marker + 4, marker + 5]

    p.on_finished("d1", doc(100), "t")  # 8 tokens
    p.on_finished("d2", doc(200), "t")  # 16
    assert p.stats()["stored_tokens"] == 16
    # A hit on d1 makes it the most recent, so d2 goes first.
    assert one(p, "q1", [0, 100, 101], tenant="t") == [7, 8, 102, 103]
    p.on_finished("d3", doc(300), "t")  # 24 > 20: evict the LRU document, d2
    st = p.stats()
    assert st["stored_tokens"] == 16 and st["documents"] == 2 and st["evicted_documents"] == 1
    assert one(p, "q2", [0, 200, 201], tenant="t") == []
    # [7, 8] was last fed by d3: its continuation comes from the newest document.
    assert one(p, "q3", [0, 7, 8], tenant="t") == [302, 303, 304, 305]
    assert one(p, "q4", [0, 100, 101], tenant="t") == [7, 8, 102, 103]  # LRU: d3, d1
    p.observe("r", [400, 401, 402, 403], "t")  # 20 tokens: fits exactly
    assert p.stats()["stored_tokens"] == 20
    p.observe("r", [400, 401, 402, 403, 404], "t")  # 21: evict the LRU document, d3
    st = p.stats()
    assert st["stored_tokens"] == 13 and st["evicted_documents"] == 2
    assert one(p, "q5", [0, 100, 101], tenant="t") == [7, 8, 102, 103]
    assert one(p, "q6", [0, 300, 301], tenant="t") == []
    assert one(p, "q7", [0, 401, 402], tenant="t") == [403, 404]


def test_suffix_feed_touches_a_running_document():
    p = SuffixProposer(4, 2, 2, suffix_cache_max_tokens=12)
    p.observe("run", [10, 11, 12, 13], "t")  # oldest document...
    p.on_finished("d", [20, 21, 22, 23], "t")
    p.observe("run", [10, 11, 12, 13, 14], "t")  # ...until this feed makes it the newest
    p.on_finished("e", [30, 31, 32], "t")  # 5 + 4 + 3 = 12: fits
    p.on_finished("f", [40, 41], "t")  # 14: evict the LRU document, d
    assert p.stats()["stored_tokens"] == 10
    assert one(p, "q", [0, 20, 21], tenant="t") == []
    assert one(p, "q2", [0, 11, 12], tenant="t") == [13, 14]


def test_suffix_budget_holds_for_long_streams_and_many_tenants():
    rng = random.Random(11)
    budget = 64
    p = SuffixProposer(3, 1, 3, suffix_cache_max_tokens=budget)
    live: dict[str, list[int]] = {}
    for step in range(400):
        sid = f"s{rng.randrange(6)}"
        tenant = f"t{int(sid[1:]) % 3}"
        toks = live.setdefault(sid, [])
        toks += [rng.randrange(30) for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.1:
            p.on_finished(sid, toks, tenant)
            del live[sid]
        else:
            p.observe(sid, toks, tenant)
        assert p.stats()["stored_tokens"] <= budget, step
        # Eviction took its table entries along: every entry points into a live document.
        for tables in p._tables.values():
            for table in tables:
                assert all(packed >> 40 in p._docs for packed in table.values()), step
    # One stream far longer than the budget keeps only recent tokens.
    q = SuffixProposer(3, 1, 3, suffix_cache_max_tokens=10)
    stream = list(range(1, 200))
    for end in range(1, len(stream) + 1, 7):
        q.observe("long", stream[:end], "t")
        assert q.stats()["stored_tokens"] <= 10
    # Documents fill to the budget in turn: 181..190 went when 191..197 arrived.
    assert q.stats()["stored_tokens"] == 7
    assert one(q, "x", [0, 194, 195], tenant="t") == [196, 197]
    assert one(q, "y", [0, 185], tenant="t") == []
    # Evicting every document of a tenant drops its tables.
    r = SuffixProposer(2, 1, 2, suffix_cache_max_tokens=4)
    r.on_finished("a", [1, 2, 3, 4], "A")
    r.on_finished("b", [5, 6, 7, 8], "B")
    assert "A" not in r._tables and r.stats()["documents"] == 1


def test_suffix_hash_collisions_never_give_wrong_drafts(colliding_hash):
    rng = random.Random(5)
    p = SuffixProposer(4, 1, 4, suffix_cache_max_tokens=300)
    corpus: list[list[int]] = []
    hits = 0
    for i in range(40):
        toks = [rng.randrange(6) for _ in range(rng.randint(4, 20))]
        p.on_finished(f"d{i}", toks, "t")
        corpus.append(toks)
        query = [rng.randrange(6) for _ in range(rng.randint(1, 5))]
        got = one(p, f"q{i}", query, tenant="t")
        if got:
            hits += 1
            assert is_true_continuation(query, query, got, 1) or any(
                is_true_continuation(c, query, got, 1) for c in corpus
            ), (query, got)
    assert hits > 5


def test_suffix_on_finished_drops_feed_and_own_state():
    p = SuffixProposer(4)
    p.observe("a", [1, 2, 3], "t")
    one(p, "a", [1, 2, 3], tenant="t")
    p.on_finished("a", [1, 2, 3, 4], "t")
    assert p._feeds == {} and p.stats()["sequences"] == 0
    assert p.stats()["documents"] == 1
