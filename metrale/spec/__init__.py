"""Speculative decoding: the configuration, the draft proposers and the throughput gate.

Owner: spec. Pure Python (no torch): the engine asks a `Proposer` for draft tokens before it
plans a step, the scheduler gives a decode row its drafts (the catch-up rule: a row computes
its last token plus its drafts), the model verifies them in one forward
(`Model.mixed_verify_batch`), the sampler accepts or rejects them
(`metrale.sampling.verify`), and the scheduler commits the accepted prefix and rolls the
rest back through `Model.commit_accepted_prefix`.
"""
