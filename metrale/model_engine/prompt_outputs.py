"""What a prompt forward produces besides its last token's logits: the pooled, normalised
embedding of an embedding request, and the logprobs of every prompt token (`prompt_logprobs`).

Owner: model-engine (called by `TransformerModel._forward` and `_mixed`).

Invariants:
- A pooling sequence's `pooled` folds every chunk's final hidden rows in order; its last chunk
  turns it into `embedding` (one host read per request) and clears the running state.
- `score_prompt` appends exactly one `PromptTokenLogprob` per chunk position that has a next
  prompt token, in prompt order.
"""

from __future__ import annotations

import torch

from metrale.model_engine.batch import ForwardRow
from metrale.model_engine.traits import PrefillSlice, PromptTokenLogprob


def pool_prompt_rows(rows: list[ForwardRow], hidden: torch.Tensor) -> None:
    """Fold each pooling prefill row's final hidden states into its sequence's
    `pooled`; the last chunk turns it into the L2-normalised `embedding` (one host read
    per embedding request, at its end)."""
    start = 0
    for r in rows:
        n, seq = len(r.tokens), r.seq
        if r.prefill and seq.pooling is not None:
            part = hidden[start : start + n].float()
            if seq.pooling == "mean":
                total = part.sum(dim=0)
                seq.pooled = total if seq.pooled is None else seq.pooled + total
                seq.pooled_count += n
            else:
                seq.pooled = part[-1]
            if r.want_logits:  # the prompt's last chunk
                vector = (
                    seq.pooled / max(seq.pooled_count, 1) if seq.pooling == "mean" else seq.pooled
                )
                seq.embedding = torch.nn.functional.normalize(vector, dim=0).tolist()
                seq.pooled, seq.pooled_count, seq.pooling = None, 0, None
        start += n


def score_prompt(sl: PrefillSlice, logits: torch.Tensor) -> None:
    """Append one PromptTokenLogprob per chunk position that has a next prompt token."""
    k = sl.seq.collect_prompt_logprobs or 0
    targets = list(sl.prompt_tokens[sl.chunk_start + 1 : sl.chunk_start + sl.chunk_len + 1])
    if not targets:
        return
    n = len(targets)
    logprobs = torch.log_softmax(logits[:n].float(), dim=-1)
    target_ids = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, target_ids).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
    top_v = top_vals.tolist() if top_vals is not None else None
    top_i = top_ids.tolist() if top_ids is not None else None
    for j in range(n):
        top = list(zip(top_i[j], top_v[j])) if top_i is not None and top_v is not None else []
        sl.seq.prompt_logprobs.append(PromptTokenLogprob(targets[j], chosen_l[j], ranks_l[j], top))
