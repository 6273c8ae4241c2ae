"""Turning the rows of one forward (decode rows, prefill chunks) into input tensors and
`AttentionMetadata`.

Owner: model-engine. Built on the host with numpy, uploaded once per forward; on the CPU a
forward of one-token decode rows only (no adapter, no recurrent state) is built from Python
lists, the same tensors without numpy's staging.

Invariants:
- Decode rows come first, then prefill chunks, in the order given; logits row `i` of the
  result belongs to the i-th row that asked for logits, in that order.
- Every row's blocks are already in its `block_table` (allocation happens before building).
- A row's positions are `start .. start + len - 1`, and `start == seq.seq_len` (except an
  MTP head's rows, `start_at`).
- On hybrid models every row carries its sequence's SSM slot; a row starting at position 0
  is marked as having no initial recurrent state.
- `lora` routes each row's tokens to its sequence's LoRA slot (`seq.adapter_slot`, -1: the
  base model); None when no row uses an adapter.
- Rows naming a `RecurrentVerify` (hybrid verify: the decode-side rows from the first one
  with drafts on) directly follow the `num_decode` decode rows; they become the metadata's
  `num_sequential` rows, and their layout (token rows, slots, per-step indices) is uploaded
  into that object once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.lora import LoraBatch
from metrale.layers.recurrent_verify import RecurrentVerify
from metrale.model_engine.traits import SequenceState


@dataclass
class ForwardRow:
    """One sequence's tokens in a forward."""

    seq: SequenceState
    tokens: list[int]
    #: Whether the last token's logits are wanted (decode rows, final prefill chunks).
    want_logits: bool
    #: Whether every token's logits are wanted (prompt logprobs).
    all_logits: bool = False
    #: First position of the row when it is not `seq.seq_len` (an MTP head's catch-up
    #: rows rewrite positions the main model has already computed).
    start_at: int | None = None
    #: A prompt chunk (not a decode or verify row).
    prefill: bool = False
    #: Hybrid verify: the forward's capture when recurrent layers run this decode-side row
    #: token by token (see `metrale.model_engine.ssm_verify`); None otherwise.
    ssm_verify: RecurrentVerify | None = None

    @property
    def start(self) -> int:
        return self.seq.seq_len if self.start_at is None else self.start_at


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    meta: AttentionMetadata
    #: Hidden rows whose logits are computed, in output order.
    logits_indices: torch.Tensor
    #: For each ForwardRow: (first logits row, number of logits rows) in the logits output.
    logits_spans: list[tuple[int, int]]
    #: LoRA routing of the rows (per-token slot tensor + per-slot row groups); None: base only.
    lora: LoraBatch | None = None
    #: `logits_indices` is every hidden row in order (one-token decode rows): the hidden
    #: states are the logits rows as they are.
    logits_every_row: bool = False


def build_forward_batch(
    rows: list[ForwardRow], num_decode: int, block_size: int, device: torch.device
) -> ForwardBatch:
    if device.type == "cpu" and num_decode == len(rows) and plain_decode_rows(rows):
        return _decode_batch(rows, block_size)
    query_lens = np.fromiter((len(r.tokens) for r in rows), dtype=np.int64, count=len(rows))
    starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=len(rows))
    seq_lens = starts + query_lens
    qsl = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    total = int(qsl[-1])
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    max_blocks = max(len(r.seq.block_table) for r in rows)
    tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
    logits_idx: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        a, b = qsl[i], qsl[i + 1]
        input_ids[a:b] = r.tokens
        positions[a:b] = np.arange(starts[i], seq_lens[i])
        tables[i, : len(r.seq.block_table)] = r.seq.block_table
        first = len(logits_idx)
        if r.all_logits:
            logits_idx.extend(range(a, b))
        elif r.want_logits:
            logits_idx.append(b - 1)
        spans.append((first, len(logits_idx) - first))
    row_of_token = np.repeat(np.arange(len(rows)), query_lens)
    slots = tables[row_of_token, positions // block_size] * block_size + positions % block_size

    def up(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    slot_list = [r.seq.ssm_slot_idx() for r in rows]
    ssm_slots = ssm_slots_host = ssm_initial = None
    if any(s is not None for s in slot_list):
        if any(s is None for s in slot_list):
            raise ValueError("a batch of a hybrid model mixes rows with and without SSM slots")
        ssm_slots_host = [int(s) for s in slot_list if s is not None]
        ssm_slots = up(np.asarray(ssm_slots_host, dtype=np.int64), torch.int64)
        ssm_initial = (starts > 0).tolist()
    num_sequential, ssm_verify = _sequential_rows(rows, num_decode, qsl, device)

    meta = AttentionMetadata(
        positions=up(positions, torch.int64),
        slot_mapping=up(slots, torch.int64),
        query_start_loc=up(qsl, torch.int32),
        seq_lens=up(seq_lens, torch.int32),
        block_tables=up(tables, torch.int32),
        num_decode=num_decode,
        query_lens_host=query_lens.tolist(),
        seq_lens_host=seq_lens.tolist(),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        ssm_slots=ssm_slots,
        ssm_slots_host=ssm_slots_host,
        ssm_has_initial_state=ssm_initial,
        query_start_loc_host=qsl.tolist(),
        num_sequential=num_sequential,
        ssm_verify=ssm_verify,
    )
    return ForwardBatch(
        input_ids=up(input_ids, torch.int64),
        meta=meta,
        logits_indices=up(np.asarray(logits_idx, dtype=np.int64), torch.int64),
        logits_spans=spans,
        lora=LoraBatch.build([r.seq.adapter_slot for r in rows], query_lens.tolist(), device),
    )


def _sequential_rows(
    rows: list[ForwardRow], num_decode: int, qsl: np.ndarray, device: torch.device
) -> tuple[int, RecurrentVerify | None]:
    """The rows after the decode rows that name the forward's `RecurrentVerify`, laid out."""
    marked = [i for i, r in enumerate(rows) if r.ssm_verify is not None]
    if not marked:
        return 0, None
    capture = rows[marked[0]].ssm_verify
    assert capture is not None
    if marked != list(range(num_decode, num_decode + len(marked))) or any(
        rows[i].ssm_verify is not capture for i in marked
    ):
        raise ValueError("sequential (verify) rows must directly follow the decode rows")
    slots = [rows[i].seq.ssm_slot_idx() for i in marked]
    if any(s is None for s in slots):
        raise ValueError("a sequential (verify) row needs an SSM slot")
    capture.lay_out(
        [int(qsl[i]) for i in marked],
        [len(rows[i].tokens) for i in marked],
        [int(s) for s in slots if s is not None],
        device,
    )
    return len(marked), capture


def plain_decode_rows(rows: list[ForwardRow]) -> bool:
    """Whether every row is a one-token decode row wanting its logits, on the base model,
    with no recurrent state (what `_decode_batch` builds)."""
    for r in rows:
        seq = r.seq
        if (
            len(r.tokens) != 1
            or not r.want_logits
            or r.all_logits
            or r.ssm_verify is not None
            or seq.adapter_slot >= 0
            or seq.ssm_slot_idx() is not None
        ):
            return False
    return True


def _decode_batch(rows: list[ForwardRow], block_size: int) -> ForwardBatch:
    """`build_forward_batch` of one-token decode rows on the CPU, from Python lists (the
    general path's numpy staging costs more than the rest of a tiny model's step)."""
    n = len(rows)
    starts = [r.start for r in rows]
    tables = [r.seq.block_table for r in rows]
    width = max(len(t) for t in tables)
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, starts)]
    lens = [p + 1 for p in starts]
    padded = [t if len(t) == width else [*t, *([0] * (width - len(t)))] for t in tables]
    meta = AttentionMetadata(
        positions=torch.tensor(starts, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        num_decode=n,
        query_lens_host=[1] * n,
        seq_lens_host=lens,
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_host=list(range(n + 1)),
    )
    return ForwardBatch(
        input_ids=torch.tensor([r.tokens[0] for r in rows], dtype=torch.int64),
        meta=meta,
        logits_indices=torch.arange(n, dtype=torch.int64),
        logits_spans=[(i, 1) for i in range(n)],
        logits_every_row=True,
    )
