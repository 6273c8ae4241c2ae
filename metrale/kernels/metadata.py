"""Attention metadata of one forward: which query rows belong to which sequence, where their
K/V go, and which paged blocks each sequence reads.

Owner: kernels (built by `metrale.model_engine.batch`, read by every attention kernel and its
reference).

Invariants:
- Rows are flattened sequence-major: sequence `b` owns rows
  `query_start_loc[b] : query_start_loc[b + 1]`, the first `num_decode` sequences own
  `decode_query_len` rows each (decode rows: rows `b * Q .. b * Q + Q - 1` of sequence b, so
  `query_start_loc[b] == b * Q` for them), the rest are prefill chunks. `Q = 1` is plain
  decode; `Q = k + 1` is a speculative verify step (the last token and k draft tokens).
- Sequence `b` attends to its first `seq_lens[b]` cached positions (the chunk's own tokens
  included, already written by `write_kv`), read through `block_tables[b]`; its query rows sit
  at positions `seq_lens[b] - query_len .. seq_lens[b] - 1`, causal among themselves (row r of
  the sequence sees positions `<= seq_lens[b] - query_len + r`). For decode rows `query_len`
  is `decode_query_len`; the decode kernels read it, never `query_lens_host`.
- `slot_mapping[t]` is the flat cache slot (`block * block_size + offset`) of row t's new K/V;
  padded rows point at the null block 0.
- Host lists mirror the tensors so CPU references and the scheduler never read the device.
- Hybrid models: `ssm_slots[b]` is sequence b's SSM pool slot; `ssm_has_initial_state[b]` is
  False when its rows start at position 0, so recurrent layers start it from a zero state
  whatever the slot held. Both are None for models without recurrent layers. In a decode
  graph's metadata (`model_engine.cuda_graphs`) `ssm_slots` is the runner's persistent buffer
  (padding rows: -1, which the recurrent decode kernels skip) and the host lists are absent.
- Hybrid verify: the `num_sequential` sequences after the `num_decode` decode rows are the
  decode-side rows from the first one with drafts on; attention treats them as prefill rows,
  recurrent layers run them token by token through their decode step and record what the
  commit's rollback needs in `ssm_verify` (`metrale.layers.recurrent_verify`). Zero and None
  otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    num_decode: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    ssm_slots: torch.Tensor | None = None  # [B] int64
    ssm_slots_host: list[int] | None = None
    ssm_has_initial_state: list[bool] | None = None
    query_start_loc_host: list[int] = field(default_factory=list)
    #: Query rows of each decode sequence (1: decode; k + 1: a speculative verify step).
    decode_query_len: int = 1
    #: Hybrid verify: sequences after the decode rows that recurrent layers run token by token.
    num_sequential: int = 0
    #: Hybrid verify: the forward's sequential-row layout and capture, a
    #: `metrale.layers.recurrent_verify.RecurrentVerify` (typed loosely: `layers` sits above
    #: `kernels`); None without one.
    ssm_verify: Any = None
    #: High-speed swap: the `metrale.cache.hss.HostKvPool` holding the blocks whose table
    #: entries are negative (the CPU reference reads them there), or on CUDA the forward's
    #: `HssStaging` (the Triton op gathers each layer's blocks through it); None otherwise.
    host_kv: Any = None

    @functools.cached_property
    def memo(self) -> dict[Any, Any]:
        """What ops derive from this forward's metadata alone, kept for the next layer (the
        CPU decode attention's block indices and mask, `kernels.cpu_ops`). Metadata with
        host lists is built for one forward and never changed, so nothing here goes stale."""
        return {}

    @functools.cached_property
    def attention_decode_seqs(self) -> int:
        """The leading sequences an attention kernel may run as decode rows: `num_decode`, or
        every sequence when the decode rows are single tokens and so is every prompt chunk
        (a prefix-cache or KV-tier hit up to the prompt's last token). One query row each, so
        the split-context decode kernel spreads a long context over the device, where a
        prefill kernel's one query tile per KV head would leave it on a few programs.
        Computed once per forward, on host lists only (graph metadata, which has none, keeps
        `num_decode`)."""
        lens = self.query_lens_host
        if (
            self.decode_query_len == 1
            and self.num_decode < len(lens) == self.seq_lens.shape[0]
            and all(n == 1 for n in lens[self.num_decode :])
        ):
            return len(lens)
        return self.num_decode

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
