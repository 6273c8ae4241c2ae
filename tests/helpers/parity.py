"""Reference generations from transformers, and the comparison every parity test makes.

Owner: tests.

Invariants:
- The reference is transformers' own `generate(do_sample=False)` on one prompt at a time (no
  padding), with `min_new_tokens` equal to the length so EOS cannot end it early; metrale runs
  the same request with `min_tokens` so both mask EOS identically.
- Logprobs are compared on the raw logits (log_softmax before any processor) at every position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.engine.request import RequestOutput


@dataclass
class Reference:
    tokens: list[int]
    #: Per generated position, log_softmax of the raw logits, float64 `[vocab]`.
    logprobs: list[torch.Tensor]


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> Reference:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].double(), dim=-1) for step in out.logits]
    return Reference(tokens, logprobs)


def assert_matches(out: RequestOutput, ref: Reference, atol: float = 1e-4) -> None:
    """Greedy tokens identical, and each position's chosen + top-N logprobs within `atol`."""
    choice = out.outputs[0]
    assert choice.token_ids == ref.tokens, (
        f"tokens differ at position {_first_diff(choice.token_ids, ref.tokens)}:\n"
        f"metrale {choice.token_ids}\nhf      {ref.tokens}"
    )
    assert choice.logprobs is not None
    worst = 0.0
    for pos, (entry, ref_lp) in enumerate(zip(choice.logprobs, ref.logprobs, strict=True)):
        for token, lp in entry.items():
            err = abs(lp.logprob - float(ref_lp[token]))
            worst = max(worst, err)
            assert err <= atol, (
                f"position {pos} token {token}: {lp.logprob} vs {float(ref_lp[token])}"
            )
    assert worst <= atol


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def mixed_prompts(count: int = 8, seed: int = 1, vocab: int = 512) -> list[list[int]]:
    """Prompts of mixed lengths from 1 to 200 tokens, random ids above the special tokens."""
    lengths = [1, 3, 9, 17, 33, 64, 120, 200, 48, 5, 150, 31][:count]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab, (n,), generator=gen).tolist() for n in lengths]


def count_identical_or_near_ties(ref: list[RequestOutput], got: list[RequestOutput]) -> int:
    """How many outputs of `got` equal `ref`'s tokens; asserts that every other one first
    diverges at a near tie: on a token among `ref`'s top alternatives there (`ref` must have
    asked for logprobs)."""
    identical = 0
    for r, g in zip(ref, got, strict=True):
        rt, gt = r.outputs[0].token_ids, g.outputs[0].token_ids
        if rt == gt:
            identical += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(rt, gt)) if a != b)
        logprobs = r.outputs[0].logprobs
        assert logprobs is not None, "the reference needs logprobs"
        top = set(logprobs[first].keys())
        assert gt[first] in top, f"token {gt[first]} not in the reference's top {top} at {first}"
    return identical
