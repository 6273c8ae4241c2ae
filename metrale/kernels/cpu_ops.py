"""Lean CPU forms of the per-layer small ops: RMSNorm, the attention layer's q/k norm + rotary
+ KV write, and plain decode attention, in fewer torch calls than the references.

Owner: kernels. `CpuOps` is built once per `KernelOps` on a CPU device (`kernels_for`); its
`LEAN_OPS` are the CPU entries of `rms_norm`, `add_rms_norm`, `rotary_write_kv`,
`qk_norm_rotary_write_kv`, `paged_attention` and the sampler's `greedy_logprobs` and
`stop_masked_greedy`, unless the
environment sets `METRALE_CPU_OPS=torch` (then the references; logged by `kernels_for`).

Why (issue 26): on the CPU a small model's decode step is bound by torch's per-call cost
(a few microseconds each), not by arithmetic: the references spend ~50 calls per layer on
the norms, the rotation and the decode attention's gather and mask, and recompute for every
layer what depends only on the forward (the block indices, the mask, the rotary rows).

Invariants:
- Each op computes the same float32 arithmetic as its reference, operation by operation
  (same products, sums and order; only no-op casts, copies and the concatenations are gone),
  so float32 results are those of `reference`; decode attention of one sequence reads
  exactly its cached positions instead of masking the tail of its last block. The exception:
  plain float32 decode attention, when the C library builds, runs its kernel
  (`metrale_paged_decode_attention_f32` in `csrc/cpu_gemv.c`: blocks read in place, no
  gather; one read of k_t / v_t for the query heads of a KV head): the same function,
  summation order aside (issue 26: the per-layer gather was ~1.3 ms of a 16-row step); and
  float32 greedy rows' sampler result (`metrale_greedy_logprobs_f32`): the same token, rank
  and samplable flag, the logprob's exponential sum in the kernel's order; and greedy rows
  under min_tokens' stop-id mask (`metrale_stop_masked_greedy_f32` after torch's logsumexp:
  the reference's values bit for bit, logits with a NaN or +inf by the reference). Anything the
  lean form does not cover (another dtype, a float8 cache, partial rotary, a sliding window,
  verify or prefill rows, high-speed swap's host blocks) runs the reference, per call.
- What depends only on the forward is computed once per forward and kept in the metadata's
  `memo` (`AttentionMetadata.memo`); the full-width rotary table (cos | cos, -sin | sin) is
  derived once per cos/sin table (weakly keyed: it goes with the table, and is rebuilt if the
  table changes in place; an inference-mode table, which has no version counter, is widened
  per call).
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from metrale.kernels import reference, sampling_reference
from metrale.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm` (float32 in place of its no-op casts; other dtypes: it)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return reference.rms_norm(x, weight, eps)
    scale = x.pow(2).mean(-1, keepdim=True)
    scale.add_(eps).rsqrt_()
    h = x * scale
    return h.mul_(weight)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.add_rms_norm` through the lean `rms_norm`."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """`[T, Hq + Hk, D]` over q's and k's memory when k's heads directly follow q's in the
    same rows (the fused QKV projection's split), else None."""
    if q.dim() != 3 or q.stride() != k.stride() or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size():
        return None
    t, hq, d = q.shape
    return q.as_strided((t, hq + k.shape[1], d), q.stride())


#: The `KernelOps` fields `CpuOps` provides (the CPU entries `kernels_for` installs).
LEAN_OPS = (
    "rms_norm", "add_rms_norm", "rotary_write_kv", "qk_norm_rotary_write_kv", "paged_attention",
    "greedy_logprobs", "stop_masked_greedy",
)  # fmt: skip


def _cpu_f32_rows(logits: torch.Tensor) -> bool:
    """Whether `logits` is the C sampler kernels' input: float32 rows `[rows, vocab]` on the
    CPU (each kernel states its own stride rule)."""
    return logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu"


class CpuOps:
    """The lean ops (`LEAN_OPS`; the norms are the module's functions, the others keep a
    derived table or a loaded C kernel: see the module docstring)."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)

    def __init__(self) -> None:
        #: The C decode attention (`metrale_paged_decode_attention_f32`) and greedy sampler
        #: results (`metrale_greedy_logprobs_f32`, `metrale_stop_masked_greedy_f32`); None
        #: where the C library cannot be built (then the gather + SDPA form and the
        #: references run; logged once).
        self._attention, self._greedy, self._stop_masked = _load_c_kernels()
        self._scores = torch.empty(0, dtype=torch.float32)
        #: id(cos/sin table) -> (a weak reference to it, its version, the full-width
        #: `[P, 2, rotary_dim]` table); an entry leaves with its table.
        self._tables: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def _full_table(self, cos_sin: torch.Tensor) -> torch.Tensor:
        """`[P, 2, rotary_dim]`: (cos | cos) and (-sin | sin), so that the rotate-half
        rotation is `x * cos2 + roll(x, half) * sin2`, term for term the reference's."""
        if cos_sin.is_inference():  # no version counter (a per-forward table, M-RoPE's)
            return self._widen(cos_sin)
        key = id(cos_sin)
        kept = self._tables.get(key)
        if kept is not None and kept[0]() is cos_sin and kept[1] == cos_sin._version:
            return kept[2]
        full = self._widen(cos_sin)
        tables = self._tables

        def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            entry = tables.get(key)
            if entry is not None and entry[0] is ref:
                del tables[key]

        self._tables[key] = (weakref.ref(cos_sin, forget), cos_sin._version, full)
        return full

    @staticmethod
    def _widen(cos_sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos_sin[:, 0], cos_sin[:, 1]
        return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)

    def _lean_rotary(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rotary_dim: int
    ) -> bool:
        """Whether the lean rotary + KV write covers the call: float32 q and caches, the
        whole head rotating, an even rotary width."""
        return (
            q.dtype == torch.float32
            and k_cache.dtype == torch.float32
            and v_cache.dtype == torch.float32
            and rotary_dim == q.shape[-1]
            and rotary_dim % 2 == 0
        )

    def _rotate_write(
        self,
        heads: torch.Tensor,
        num_q: int,
        positions: torch.Tensor,
        v: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate `heads` (`[T, Hq + Hk, D]`, a fresh tensor or a view), store its k heads
        and `v` in the caches, return its q heads."""
        table = self._full_table(cos_sin).index_select(0, positions)
        half = heads.shape[-1] // 2
        out = heads * table[:, 0:1]
        turned = heads.roll(half, dims=-1)
        out.add_(turned.mul_(table[:, 1:2]))
        num_kv, dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv, dim).index_copy_(0, slot_mapping, out[:, num_q:])
        v_cache.view(-1, num_kv, dim).index_copy_(0, slot_mapping, v)
        return out[:, :num_q]

    def rotary_write_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: torch.Tensor,
        rotary_dim: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`reference.rotary_write_kv`."""
        if not self._lean_rotary(q, k_cache, v_cache, rotary_dim):
            return reference.rotary_write_kv(
                positions, q, k, v, cos_sin, rotary_dim, k_cache, v_cache, slot_mapping,
                k_scale, v_scale,
            )  # fmt: skip
        heads = _adjacent_heads(q, k)
        if heads is None:
            heads = torch.cat((q, k), dim=1)
        return self._rotate_write(
            heads, q.shape[1], positions, v, cos_sin, k_cache, v_cache, slot_mapping
        )

    def qk_norm_rotary_write_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos_sin: torch.Tensor,
        rotary_dim: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`reference.qk_norm_rotary_write_kv`: q's and k's heads normalised together (the
        same per-head arithmetic), each with its weight, then rotated and written."""
        if (
            not self._lean_rotary(q, k_cache, v_cache, rotary_dim)
            or q_weight.dtype != torch.float32
            or k_weight.dtype != torch.float32
        ):
            return reference.qk_norm_rotary_write_kv(
                positions, q, k, v, q_weight, k_weight, eps, cos_sin, rotary_dim, k_cache,
                v_cache, slot_mapping, k_scale, v_scale,
            )  # fmt: skip
        heads = _adjacent_heads(q, k)
        if heads is None:
            heads = torch.cat((q, k), dim=1)
        num_q = q.shape[1]
        scale = heads.pow(2).mean(-1, keepdim=True)
        scale.add_(eps).rsqrt_()
        normed = heads * scale
        normed[:, :num_q].mul_(q_weight)
        normed[:, num_q:].mul_(k_weight)
        return self._rotate_write(
            normed, num_q, positions, v, cos_sin, k_cache, v_cache, slot_mapping
        )

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`paged_attention`, plain float32 decode rows by the C kernel when it is loaded:
        it reads each row's blocks where they are (no gather) and each KV head's k_t / v_t
        once for the query heads that share it; the same function, summation order aside."""
        nd = meta.num_decode
        fn = self._attention
        if (
            fn is None
            or not _plain_decode(q, k_cache, v_cache, meta, sliding_window)
            or q.dtype != torch.float32
            or q.stride(-1) != 1
            or q.stride(1) != q.shape[2]
            or not k_cache.is_contiguous()
            or not v_cache.is_contiguous()
        ):
            return paged_attention(
                q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale
            )
        layout = meta.memo.get("cpu_c_attention")
        if layout is None:
            lens = meta.seq_lens_host[:nd]
            layout = meta.memo["cpu_c_attention"] = (
                torch.tensor(lens, dtype=torch.int32),
                meta.block_tables[:nd].to(torch.int32).contiguous(),
                max(lens),
            )
        lens_t, tables, max_len = layout
        heads, kv_heads, dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
        threads = torch.get_num_threads()
        need = threads * (heads // kv_heads) * max_len
        if self._scores.numel() < need:
            self._scores = torch.empty(need, dtype=torch.float32)
        out = torch.empty((nd, heads, dim), dtype=torch.float32)
        fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), nd, heads,
            kv_heads, dim, k_cache.shape[1], lens_t.data_ptr(), tables.data_ptr(),
            tables.stride(0), scale, out.data_ptr(), heads * dim, self._scores.data_ptr(),
            threads,
        )  # fmt: skip
        return out

    def greedy_logprobs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_logprobs` (the sampler's result for plain greedy rows), float32 logits by
        the C kernel when it is loaded: one call instead of ~15 torch ops (issue 26: ~50 us
        of a 0.2 ms tiny-model step). The same tokens, ranks and samplable flags; the
        logprob's exponential sum in its own fixed order (a few float32 ulp)."""
        fn = self._greedy
        if fn is None or not _cpu_f32_rows(logits) or logits.stride(-1) != 1:
            return sampling_reference.greedy_logprobs(logits)
        rows, vocab = logits.shape
        ids = torch.empty(rows, dtype=torch.int64)
        packed = torch.empty((rows, 4), dtype=torch.float64)
        fn(logits.data_ptr(), rows, vocab, logits.stride(0), ids.data_ptr(), packed.data_ptr())
        return ids, packed

    def stop_masked_greedy(
        self, logits: torch.Tensor, banned: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`stop_masked_greedy` (the sampler's result for greedy rows whose only processing is
        min_tokens' stop-id mask): torch's logsumexp of each row, as the reference computes
        it, then the C kernel (comparisons and the one float32 subtraction), so every value is
        the reference's, bit for bit, in two calls instead of ~25 (issue 26: a served
        benchmark's every token takes this path while its min_tokens holds). Logits with a
        NaN or +inf (the kernel says so) take the reference."""
        fn = self._stop_masked
        if fn is None or not _cpu_f32_rows(logits) or not logits.is_contiguous():
            return sampling_reference.stop_masked_greedy(logits, banned)
        rows, vocab = logits.shape
        starts = [0]
        flat: list[int] = []
        for ids in banned:
            flat.extend(ids)
            starts.append(len(flat))
        lse = torch.logsumexp(logits, dim=-1)  # the reference's, its logits having no NaN / +inf
        ids_t = torch.empty(rows, dtype=torch.int64)
        packed = torch.empty((rows, 4), dtype=torch.float64)
        if fn(
            logits.data_ptr(), rows, vocab, vocab, (ctypes.c_long * len(starts))(*starts),
            (ctypes.c_long * len(flat))(*flat), lse.data_ptr(), ids_t.data_ptr(),
            packed.data_ptr(),
        ):  # fmt: skip
            return sampling_reference.stop_masked_greedy(logits, banned)
        return ids_t, packed


def _load_c_kernels() -> tuple[Any, Any, Any]:
    """`metrale_paged_decode_attention_f32`, `metrale_greedy_logprobs_f32` and
    `metrale_stop_masked_greedy_f32` from the C library (one build), or (None, None, None)
    (logged: the torch forms run)."""
    from metrale.kernels import cpu_gemv

    ptr, long, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    try:
        path = cpu_gemv.build()
        attention = cpu_gemv.kernel_function(
            path, "metrale_paged_decode_attention_f32",
            [ptr, long, ptr, ptr, long, long, long, long, long, ptr, ptr, long, f32, ptr, long,
             ptr, ctypes.c_int],
        )  # fmt: skip
        greedy = cpu_gemv.kernel_function(
            path, "metrale_greedy_logprobs_f32", [ptr, long, long, long, ptr, ptr]
        )
        stop_masked = cpu_gemv.kernel_function(
            path,
            "metrale_stop_masked_greedy_f32",
            [ptr, long, long, long, ptr, ptr, ptr, ptr, ptr],
            long,
        )
    except cpu_gemv.GemvUnavailable as exc:
        logger.info(
            "CPU decode attention and greedy sampling: the torch forms (no C kernel: %s)", exc
        )
        return None, None, None
    return attention, greedy, stop_masked


def _plain_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    sliding_window: int | None,
) -> bool:
    """A forward of plain one-token decode rows of resident blocks in q's dtype."""
    nd = meta.num_decode
    return (
        nd > 0
        and nd == meta.num_seqs
        and meta.decode_query_len == 1
        and meta.host_kv is None
        and sliding_window is None
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and bool(meta.seq_lens_host)
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.paged_attention`; a forward of plain decode rows only (no sliding window,
    cache in q's dtype, every block resident) gathers with the forward's block indices,
    computed once for all layers, and one sequence reads exactly its cached positions."""
    nd = meta.num_decode
    if not _plain_decode(q, k_cache, v_cache, meta, sliding_window):
        return reference.paged_attention(
            q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale
        )
    block_size = k_cache.shape[1]
    key = ("cpu_decode", block_size)
    layout = meta.memo.get(key)
    if layout is None:
        layout = meta.memo[key] = _decode_layout(meta, block_size, q.device)
    flat, length, mask = layout
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, flat).view(nd, -1, heads, dim)
    v = v_cache.index_select(0, flat).view(nd, -1, heads, dim)
    if mask is None:  # one sequence: exactly its positions
        k, v = k[:, :length], v[:, :length]
    attn = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [nd, Hq, 1, D]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return attn.squeeze(2)


def _decode_layout(
    meta: AttentionMetadata, block_size: int, device: torch.device
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """`(flat block indices, longest length, mask [nd, 1, 1, L] or None for one sequence)`."""
    nd = meta.num_decode
    lens = meta.seq_lens_host[:nd]
    max_len = max(lens)
    nblocks = (max_len + block_size - 1) // block_size
    flat = meta.block_tables[:nd, :nblocks].reshape(-1).long()
    if nd == 1:
        return flat, max_len, None
    k_pos = torch.arange(nblocks * block_size, device=device)
    lens_t = torch.tensor(lens, device=device)
    mask = k_pos[None, :] < lens_t[:, None]
    return flat, max_len, mask[:, None, None, :]
