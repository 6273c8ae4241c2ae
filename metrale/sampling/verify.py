"""Lossless verification of draft tokens: greedy acceptance and rejection sampling.

Owner: sampling. NOT YET IMPLEMENTED: the interface the engine is written against.

`verify(sampler, logits, rows, drafts) -> SampledBatch` scores every position of every row:
row `i` owns logits rows `offsets[i] .. offsets[i] + len(drafts[i])` (offsets are the prefix
sums of `len(drafts[j]) + 1`); the returned batch has one entry per position, whose token is
the one the target emits there, and `emitted` marks the positions whose token is emitted.
"""
