"""The `width` largest values of each row of a `[N, V]` float32 tensor, sorted, on CUDA: the
sampler's candidate cut (`sampling.candidates.candidate_draw`) without `torch.topk`'s
multi-pass radix select (0.38 ms of a 128-row Qwen3-vocabulary sampled step on the H200,
`tools/bench_sampler.py --profile --profile-batch 128`).

Owner: kernels. `row_topk` is the CUDA entry of the `KernelOps` op of the same name
(`sampling_reference.row_topk` is its reference).

How (four launches, no host read):
1. chunk maxima: each program reads `GROUP` chunks of `CHUNK` columns of a row and stores
   each chunk's largest order key (`triton_key_search.order_key`; NaN is the largest key);
2. threshold: per row, the `width`-th largest chunk maximum `t` (a sort of the row's chunk
   maxima). At least `width` chunks hold a key >= `t`, so at least `width` values do, and
   every value among the row's `width` largest is >= `t`; the row's counter is zeroed;
3. compaction: every value >= `t` is appended to the row's buffer of `BUF` slots (an atomic
   counter per row gives each program its place), packed as `(key << 32) | (2**31 - 1 - id)`;
   a program whose chunks all lie below `t` reads nothing more;
4. sort: per row the buffer is sorted (descending: larger key first, then lower id) and the
   first `width` entries are unpacked to values and ids.

Invariants:
- A row with at most `BUF` values >= `t` gets exactly its `width` largest values, in
  descending order (ties: lower id first; NaN first, as `torch.topk` ranks it). The values
  are the input's bits, except that -0.0 comes back as +0.0 (they share a key).
- A row with more (a threshold that many values tie at, or a row mostly -inf) cannot be
  finished in the buffer: its first value is set to NaN and its other entries are not
  meaningful. Callers must treat such a row as not exact (the candidate draw re-routes a
  NaN row to its full-row draw, so its token never depends on this shortcut).
- The kernels run only where the row has at least `MIN_CHUNKS_PER_WIDTH * width` chunks (a
  tight threshold) and `width <= BUF` (`usable`); `row_topk` takes `torch.topk` otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_key_search import from_order_key, order_key

#: Columns per chunk (the threshold's granularity) and chunks per program of passes 1 and 3.
CHUNK = 256
GROUP = 16
#: Buffer slots per row: the candidates >= the threshold that a row can hold.
BUF = 1024
#: Fewest chunks per candidate width for the kernel to take a row (a tight threshold: with
#: 4 chunks a candidate, about 1.3x `width` values pass it on random logits).
MIN_CHUNKS_PER_WIDTH = 4
#: The order keys of "below everything" and of NaN.
_KEY_MIN = tl.constexpr(-2147483648)
_KEY_NAN = tl.constexpr(2147483647)


def usable(vocab: int, width: int) -> bool:
    """Whether rows of `vocab` columns can take the kernel for `width` candidates."""
    chunks = triton.cdiv(vocab, CHUNK)
    return width <= BUF and chunks >= width * MIN_CHUNKS_PER_WIDTH


@triton.jit
def _key(x):
    return tl.where(x != x, _KEY_NAN, order_key(x))


@triton.jit
def _chunk_keys(row_ptr, chunk, V, CHUNK: tl.constexpr):
    """The columns `[len(chunk), CHUNK]` of the chunks `chunk` of a row and their order keys
    (`_KEY_MIN` past the row's end)."""
    cols = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    inside = cols < V
    x = tl.load(row_ptr + cols, mask=inside, other=0.0)
    return cols, tl.where(inside, _key(x), _KEY_MIN)


@triton.jit
def _chunk_max_kernel(
    x_ptr, cmax_ptr, V, S, stride_x,
    CHUNK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    _, keys = _chunk_keys(x_ptr + row * stride_x, chunk, V, CHUNK)
    tl.store(cmax_ptr + row * S + chunk, tl.max(keys, axis=1), mask=chunk < S)


@triton.jit
def _threshold_kernel(cmax_ptr, thr_ptr, count_ptr, S, width, SP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SP)
    keys = tl.load(cmax_ptr + row * S + j, mask=j < S, other=_KEY_MIN)
    ordered = tl.sort(keys, descending=True)
    tl.store(thr_ptr + row, tl.max(tl.where(j == width - 1, ordered, _KEY_MIN), axis=0))
    tl.store(count_ptr + row, 0)


@triton.jit
def _compact_kernel(
    x_ptr, cmax_ptr, thr_ptr, count_ptr, buf_ptr, V, S, stride_x,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, BUF: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    t = tl.load(thr_ptr + row)
    cmax = tl.load(cmax_ptr + row * S + chunk, mask=chunk < S, other=_KEY_MIN)
    if tl.max(cmax, axis=0) >= t:
        cols, keys = _chunk_keys(x_ptr + row * stride_x, chunk, V, CHUNK)
        take = keys >= t
        flat_take = tl.reshape(take, [GROUP * CHUNK]).to(tl.int32)
        n = tl.sum(flat_take, axis=0)
        base = tl.atomic_add(count_ptr + row, n)
        slot = base + tl.cumsum(flat_take, axis=0) - 1
        flat_keys = tl.reshape(keys, [GROUP * CHUNK]).to(tl.int64)
        flat_cols = tl.reshape(cols, [GROUP * CHUNK]).to(tl.int64)
        packed = (flat_keys << 32) | (2147483647 - flat_cols)
        keep = (flat_take > 0) & (slot < BUF)
        tl.store(buf_ptr + row * BUF + slot, packed, mask=keep)


@triton.jit
def _sort_kernel(
    buf_ptr, count_ptr, values_ptr, ids_ptr, width,
    BUF: tl.constexpr, WP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(count_ptr + row)
    j = tl.arange(0, BUF)
    packed = tl.load(buf_ptr + row * BUF + j, mask=j < n, other=-9223372036854775808)
    ordered = tl.sort(packed, descending=True)
    # The first WP entries of the sorted buffer: a WP-wide view through a one-hot gather is
    # not expressible, so keep the first WP by position (WP <= BUF, both powers of two).
    head = tl.reshape(ordered, [BUF // WP, WP])
    first = tl.sum(tl.where(tl.arange(0, BUF // WP)[:, None] == 0, head, 0), axis=0)
    i = tl.arange(0, WP)
    keys = (first >> 32).to(tl.int32)
    ids = 2147483647 - (first & 2147483647)
    values = from_order_key(keys)
    values = tl.where((i == 0) & (n > BUF), float("nan"), values)
    tl.store(values_ptr + row * width + i, values, mask=i < width)
    tl.store(ids_ptr + row * width + i, ids, mask=i < width)


def row_topk(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values [N, width] float32, ids [N, width] int64)`: each row's `width` largest values
    of `x` `[N, V]` (float32, CUDA), descending; see the module invariants for rows marked
    NaN. Falls back to `torch.topk` where `usable` says the shape does not fit."""
    rows, vocab = x.shape
    if not usable(vocab, width) or rows == 0:
        return x.topk(width, dim=-1, sorted=True)
    if x.stride(1) != 1:
        x = x.contiguous()
    dev = x.device
    chunks = triton.cdiv(vocab, CHUNK)
    cmax = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    thr = torch.empty(rows, dtype=torch.int32, device=dev)
    count = torch.empty(rows, dtype=torch.int32, device=dev)
    buf = torch.empty((rows, BUF), dtype=torch.int64, device=dev)
    values = torch.empty((rows, width), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, width), dtype=torch.int64, device=dev)
    grid = (rows, triton.cdiv(chunks, GROUP))
    _chunk_max_kernel[grid](x, cmax, vocab, chunks, x.stride(0), CHUNK=CHUNK, GROUP=GROUP)
    _threshold_kernel[(rows,)](cmax, thr, count, chunks, width, SP=triton.next_power_of_2(chunks))
    _compact_kernel[grid](
        x, cmax, thr, count, buf, vocab, chunks, x.stride(0), CHUNK=CHUNK, GROUP=GROUP, BUF=BUF
    )
    _sort_kernel[(rows,)](
        buf, count, values, ids, width, BUF=BUF, WP=triton.next_power_of_2(width)
    )  # fmt: skip
    return values, ids
