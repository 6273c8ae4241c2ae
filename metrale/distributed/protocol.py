"""Rank 0's step commands to the workers: what one forward needs, packed into two int64
tensors (a fixed header, then the payload), and rebuilt into the same `AttentionMetadata` on
every rank.

Owner: distributed.

Invariants:
- A command is one header broadcast on the control group (`HEADER_LEN` int64: the command,
  then its sizes), then its payload if it has one; the worker allocates the payload from the
  header alone.
- `FORWARD`'s payload is the step's host inputs (input ids, positions, slot mapping, query
  starts, sequence lengths, block tables, query lengths); `unpack_forward` gives the same
  tensors, dtypes and host lists as rank 0's `build_forward_batch`, on the worker's device.
  Features whose metadata is not carried (recurrent slots, high-speed swap, hybrid verify,
  vision positions) are refused at start-up, so the packer never meets them.
- `LOGITS` carries only the row count: the hidden rows follow on the model group.
"""

from __future__ import annotations

import torch

from metrale.kernels.metadata import AttentionMetadata

HEADER_LEN = 12
#: Commands (header[0]).
FORWARD, LOGITS, STOP = 1, 2, 3


def header(command: int, *fields: int) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.int64)
    out[0] = command
    if fields:
        out[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return out


def pack_forward(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(header, payload)` of one forward (CPU int64)."""
    if positions.dim() != 1 or meta.ssm_slots is not None or meta.host_kv is not None:
        raise ValueError(
            "tensor parallel forwards carry plain positions and paged KV only (no M-RoPE, "
            "recurrent slots or host KV)"
        )
    tables = meta.block_tables
    batch, width = (int(tables.shape[0]), int(tables.shape[1])) if tables.dim() == 2 else (0, 0)
    parts = [
        input_ids.reshape(-1), positions, meta.slot_mapping, meta.query_start_loc,
        meta.seq_lens, tables.reshape(-1),
    ]  # fmt: skip
    flat = [p.to("cpu", torch.int64) for p in parts]
    flat.append(torch.tensor(meta.query_lens_host, dtype=torch.int64))
    payload = torch.cat(flat)
    head = header(
        FORWARD, int(input_ids.numel()), int(meta.seq_lens.shape[0]), batch, width,
        meta.num_decode, meta.max_query_len, meta.max_seq_len, meta.decode_query_len,
        int(payload.numel()),
    )  # fmt: skip
    return head, payload


def payload_len(head: torch.Tensor) -> int:
    return int(head[9])


def unpack_forward(
    head: torch.Tensor, payload: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """`(input_ids, positions, meta)` of the forward `pack_forward` packed."""
    tokens, seqs, batch, width, num_decode, max_q, max_s, decode_q = (int(x) for x in head[1:9])
    sizes = [tokens, tokens, tokens, seqs + 1, seqs, batch * width, seqs]
    ids, pos, slots, qsl, lens, tables, qlens = torch.split(payload, sizes)
    qsl_host = qsl.tolist()
    meta = AttentionMetadata(
        positions=pos.to(device),
        slot_mapping=slots.to(device),
        query_start_loc=qsl.to(device, torch.int32),
        seq_lens=lens.to(device, torch.int32),
        block_tables=tables.reshape(batch, width).to(device, torch.int32),
        num_decode=num_decode,
        query_lens_host=qlens.tolist(),
        seq_lens_host=lens.tolist(),
        max_query_len=max_q,
        max_seq_len=max_s,
        query_start_loc_host=qsl_host,
        decode_query_len=decode_q,
    )
    return ids.to(device), meta.positions, meta
