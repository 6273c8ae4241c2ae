"""The torch references the Triton kernels are checked against compute what the layers and the
sampler compute: the fused rotary ops equal RMSNorm + `RotaryEmbedding`, the rotary ops that
write the KV cache equal rotary + `write_kv`, and the sampling reference equals the sampler's
top-k -> softmax -> min-p -> top-p filter chain.

CPU only, no triton needed.
"""

from __future__ import annotations

import torch

from metrale.kernels import reference
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.rotary import RotaryEmbedding
from metrale.models.config import RopeConfig
from metrale.sampling.logits_processors import apply_min_p, apply_top_k, apply_top_p


def test_rotary_references_match_the_layer() -> None:
    g = torch.Generator().manual_seed(0)
    for partial in (1.0, 0.5):
        rotary = RotaryEmbedding(RopeConfig(theta=1e6, partial_rotary_factor=partial), 32, 128)
        q = torch.randn(5, 4, 32, generator=g)
        k = torch.randn(5, 2, 32, generator=g)
        positions = torch.tensor([0, 3, 77, 127, 9])
        want = rotary(positions, q, k)
        got = reference.rotary_embedding(positions, q, k, rotary.cos_sin, rotary.rotary_dim)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

        qw, kw = torch.randn(32, generator=g), torch.randn(32, generator=g)
        normed = reference.rms_norm(q, qw, 1e-6), reference.rms_norm(k, kw, 1e-6)
        want = rotary(positions, *normed)
        got = reference.qk_norm_rotary(
            positions, q, k, qw, kw, 1e-6, rotary.cos_sin, rotary.rotary_dim
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_write_kv_references_compose_rotary_and_write_kv() -> None:
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([3, 40, 17, 0, 62])
    positions = torch.tensor([0, 3, 77, 127, 9])
    for partial, dtype in ((1.0, torch.float32), (0.5, torch.bfloat16)):
        rotary = RotaryEmbedding(RopeConfig(theta=1e6, partial_rotary_factor=partial), 32, 128)
        qkv = torch.randn(5, 8 * 32, generator=g).to(dtype)
        q, k, v = (t.view(5, -1, 32) for t in qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1))
        qw, kw = torch.randn(32, generator=g).to(dtype), torch.randn(32, generator=g).to(dtype)
        cache = torch.randn(2, 4, 16, 2, 32, generator=g).to(dtype)
        table = rotary.cos_sin, rotary.rotary_dim
        for norm in (False, True):
            want_k, want_v = cache[0].clone(), cache[1].clone()
            got_k, got_v = cache[0].clone(), cache[1].clone()
            if norm:
                want_q, rot_k = reference.qk_norm_rotary(positions, q, k, qw, kw, 1e-6, *table)
                got_q = reference.qk_norm_rotary_write_kv(
                    positions, q, k, v, qw, kw, 1e-6, *table, got_k, got_v, slots
                )
            else:
                want_q, rot_k = reference.rotary_embedding(positions, q, k, *table)
                got_q = reference.rotary_write_kv(positions, q, k, v, *table, got_k, got_v, slots)
            reference.write_kv(rot_k, v, want_k, want_v, slots)
            assert torch.equal(got_q, want_q)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
            assert torch.equal(got_k.view(-1, 2, 32)[slots], rot_k)


def test_sampling_filter_reference_matches_the_sampler_chain() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 300
    logits = torch.randn(6, vocab, generator=g) * 2
    logits[2] = torch.round(logits[2])  # ties
    top_k = torch.tensor([0, 5, 40, 1, vocab, 17])
    top_p = torch.tensor([0.5, 1.0, 0.95, 0.3, 0.99, 0.7])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.02])

    k_on = (top_k > 0) & (top_k < vocab)
    x = torch.where(
        k_on.unsqueeze(1), apply_top_k(logits, torch.where(k_on, top_k, vocab), vocab), logits
    )
    probs = apply_top_p(apply_min_p(torch.softmax(x, dim=-1), min_p), top_p)

    got, samplable = reference.top_k_top_p_filter(logits, top_k, top_p, min_p)
    assert samplable.all()
    assert torch.equal(got, probs)


def test_argmax_reference() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 0.0, -1.0], [float("-inf")] * 3])
    ids, values = reference.argmax(x)
    assert ids.tolist() == [1, 1, 0]
    assert values.tolist() == [3.0, 0.0, float("-inf")]


def _paged_meta(
    query_lens: list[int], seq_lens: list[int], num_decode: int, decode_query_len: int,
    tables: torch.Tensor, block_size: int,
) -> AttentionMetadata:  # fmt: skip
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    seq_of = [b for b, q in enumerate(query_lens) for _ in range(q)]
    slots = [int(tables[b, p // block_size]) * block_size + p % block_size
             for b, p in zip(seq_of, positions)]  # fmt: skip
    return AttentionMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        num_decode=num_decode,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=qsl,
        decode_query_len=decode_query_len,
    )


def test_verify_decode_rows_equal_the_prefill_branch() -> None:
    """Decode sequences of Q rows each (a speculative verify step) compute what the generic
    per-sequence causal branch computes for the same rows as Q-token chunks."""
    g = torch.Generator().manual_seed(3)
    block_size, kv_heads, head_dim = 16, 2, 32
    # Three verify sequences (one shorter than a block, one straddling blocks), one chunk.
    for ql in (1, 2, 5):
        seq_lens = [ql + 1, 33, 17 + ql, 40]
        query_lens = [ql, ql, ql, 9]
        blocks = [-(-n // block_size) for n in seq_lens]
        num_blocks = 1 + sum(blocks)
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int64)
        for b, n in enumerate(blocks):
            tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).double()
        v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).double()
        for group in (1, 2, 4):
            q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g).double()
            for window in (None, 6):
                args = (query_lens, seq_lens)
                verify = _paged_meta(*args, 3, ql, tables, block_size)
                generic = _paged_meta(*args, 0, 1, tables, block_size)
                got = reference.paged_attention(q, k_cache, v_cache, verify, 0.2, window)
                want = reference.paged_attention(q, k_cache, v_cache, generic, 0.2, window)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
