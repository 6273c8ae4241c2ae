"""Compile every Triton kernel for sm_90 (H100/H200) on a machine WITHOUT a GPU, and report
registers, spills, shared memory and a few SASS instruction counts per specialisation.

Usage: `.venv/bin/python tests/gpu/compile_sm90.py` (a developer tool, not a test; needs
triton with its bundled ptxas/cuobjdump). It catches what the CPU interpreter cannot: front-end
errors of the compiled path, register spills (`LDL`/`STL`, stack bytes), whether the dots
became tensor-core instructions (`HMMA` mma.sync, `HGMMA` wgmma) and whether loads are
pipelined (`LDGSTS` cp.async) or 16 bytes wide (`LDG.E.128`).

How: a stand-in Triton driver reports an sm_90 target, and `JITFunction.run` is redirected to
`warmup=True` (compile only, never launch), so the real launch wrappers run on CPU tensors
with Qwen3-8B-like shapes and each launch compiles exactly the specialisation it would get.
Relies on Triton 3.6 internals (driver object, `JITFunction.run` signature).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


class _Sm90Driver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def is_active(self) -> bool:
        return True

    def get_device_interface(self) -> Any:
        return torch.cuda


_compiled: list[tuple[str, dict[str, Any], Any]] = []


def _install() -> None:
    driver.set_active(_Sm90Driver())
    original = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        _compiled.append((self.fn.__name__, kwargs, kernel))
        return kernel

    JITFunction.run = run  # type: ignore[method-assign]


def _launch_everything() -> None:
    from metrale.kernels import triton_attention as ta
    from metrale.kernels import triton_norm as tn
    from metrale.kernels import triton_rotary as tr
    from metrale.kernels import triton_sampling as ts
    from metrale.kernels.metadata import AttentionMetadata

    bf = torch.bfloat16
    tokens, hidden, inter = 8, 4096, 12288
    x = torch.randn(tokens, hidden, dtype=bf)
    w = torch.randn(hidden, dtype=bf)
    tn.rms_norm(x, w, 1e-6)
    tn.add_rms_norm(x, x, w, 1e-6)
    tn.silu_and_mul(torch.randn(tokens, 2 * inter, dtype=bf))
    hq, hk, d = 32, 8, 128
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=bf)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    cos_sin = torch.randn(4096, 2, d // 2)
    positions = torch.arange(tokens)
    tr.rotary_embedding(positions, q, k, cos_sin, d)
    tr.qk_norm_rotary(positions, q, k, w[:d], w[:d], 1e-6, cos_sin, d)
    tr.rotary_embedding(positions, q, k, torch.randn(4096, 2, d // 4), d // 2)
    for dtype, dim, block_size, group in [
        (bf, 128, 16, 4),
        (bf, 128, 32, 4),
        (torch.float16, 128, 16, 7),
        (bf, 64, 16, 8),
        (bf, 256, 16, 2),
        (torch.float32, 128, 16, 4),
        (torch.float32, 256, 16, 2),
    ]:
        blocks, rows = 64, 4
        k_cache = torch.randn(blocks, block_size, hk, dim, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        kv = torch.randn(tokens, hk, dim, dtype=dtype)
        ta.write_kv(kv, kv, k_cache, v_cache, torch.arange(tokens))
        lens = torch.full((rows,), 100, dtype=torch.int32)
        tables = torch.randint(1, blocks, (rows, 16), dtype=torch.int32)
        qd = torch.randn(rows, hk * group, dim, dtype=dtype)
        ta.decode_attention(qd, k_cache, v_cache, lens, tables, 0.1, None, num_splits=1)
        ta.decode_attention(qd, k_cache, v_cache, lens, tables, 0.1, 64, num_splits=8)
        for ql in (2, 5, 9):  # speculative verify: Q rows per sequence
            qv = torch.randn(rows * ql, hk * group, dim, dtype=dtype)
            ta.decode_attention(qv, k_cache, v_cache, lens, tables, 0.1, None, query_len=ql,
                                num_splits=8)  # fmt: skip
        meta = AttentionMetadata(
            positions=torch.arange(rows),
            slot_mapping=torch.arange(rows),
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32) * 20,
            seq_lens=lens,
            block_tables=tables,
            num_decode=0,
            query_lens_host=[20] * rows,
            seq_lens_host=[100] * rows,
            max_query_len=20,
            max_seq_len=100,
        )
        qp = torch.randn(20 * rows, hk * group, dim, dtype=dtype)
        ta.prefill_attention(qp, k_cache, v_cache, meta, 0.1, None, torch.empty_like(qp), 0)
        ta.prefill_attention(qp, k_cache, v_cache, meta, 0.1, 100, torch.empty_like(qp), 0)
    _launch_fp8_kv()
    logits = torch.randn(4, 151_936)
    ts.argmax(logits)
    ks = torch.zeros(4, dtype=torch.int64)
    ts.top_k_top_p_sample(logits, ks, torch.ones(4), torch.rand(4, dtype=torch.float64))
    ts.top_k_top_p_filter(logits, ks, torch.ones(4))
    from metrale.kernels import triton_row_topk

    for width in (64, 128):
        triton_row_topk.row_topk(logits, width)
    _launch_fp8()
    _launch_ssm()
    _launch_moe()
    _launch_lora()
    _launch_gemv_lora()
    _launch_prefetch()


def _launch_prefetch() -> None:
    """The L2 prefetch hint (inline PTX: `cp.async.bulk.prefetch.L2.global`), with and
    without PDL (called on the kernel: its launcher takes CUDA tensors only)."""
    from metrale.kernels import triton_prefetch as tp

    for pdl in (False, True):
        tp._l2_prefetch_kernel[(4,)](
            1 << 40, 3 << 20, CHUNK=tp.CHUNK, BLOCK=tp.CHUNKS_PER_PROGRAM, PDL=pdl, num_warps=4
        )


def _launch_gemv_lora() -> None:
    """The GEMV at Qwen3-8B's four group shapes (bf16, one and two rows, PDL) plain and with
    the LoRA epilogue (rank 16 over 8 slots) after its shrink (of silu(gate) * up for down),
    and a split-K GEMV whose reduce kernel adds the epilogue."""
    from metrale.kernels import triton_gemv as tg
    from metrale.kernels.triton_lora_epilogue import lora_shrink

    bf, slots, rank = torch.bfloat16, 8, 16
    groups = (
        (4096, (4096, 1024, 1024), False),
        (4096, (4096,), False),
        (4096, (12288, 12288), False),
        (12288, (4096,), True),
    )
    for fan_in, widths, act in groups:
        w = torch.empty(sum(widths), fan_in, dtype=bf)
        a = torch.randn(slots, len(widths), rank, fan_in, dtype=bf)
        b_t = torch.randn(slots, rank, sum(widths), dtype=bf)
        scales = torch.ones(slots, len(widths))
        run = tg.gemv_silu_mul if act else tg.gemv
        for m in (1, 2):
            x = torch.randn(m, (2 if act else 1) * fan_in, dtype=bf)
            token_slots = torch.zeros(m, dtype=torch.int64)
            run(x, w, None, pdl=True)
            lora = lora_shrink(x, a, b_t, token_slots, scales, widths, act=act, pdl=True)
            run(x, w, None, pdl=True, lora=lora)
        run(x, w, None, config=tg.GemvConfig(split_k=4), lora=lora)


def _launch_lora() -> None:
    """The multi-LoRA group ops at Qwen3-8B's qkv and down shapes, rank 16 over 8 slots: the
    gather forms (split, fused, sync) at one row, the grouped tiles and the plan at 64."""
    from metrale.kernels import triton_lora as tl_
    from metrale.kernels import triton_lora_tiles as tiles_

    bf, slots, rank = torch.bfloat16, 8, 16
    for fan_in, widths in ((4096, (4096, 1024, 1024)), (12288, (4096,))):
        a = torch.randn(slots, len(widths), rank, fan_in, dtype=bf)
        b_t = torch.randn(slots, rank, sum(widths), dtype=bf)
        scales = torch.ones(slots, len(widths))
        x, y = torch.randn(1, fan_in, dtype=bf), torch.randn(1, sum(widths), dtype=bf)
        one = torch.zeros(1, dtype=torch.int64)
        for form in ("split", "fused"):
            tl_.lora_gather_add(y, x, a, b_t, one, scales, widths, pdl=True, form=form)
        g = tl_._geometry("sync", y, x, a, b_t, widths, None, 256, 64)
        sync = torch.zeros(4, dtype=torch.int32)
        tl_.launch_sync(y, x, a, b_t, one, scales, g, sync, True)
        many = torch.arange(64) % slots
        x, y = torch.randn(64, fan_in, dtype=bf), torch.randn(64, sum(widths), dtype=bf)
        order, tiles = torch.zeros(64, dtype=torch.int32), torch.zeros(12, 3, dtype=torch.int32)
        tiles_.lora_tiles_add(y, x, a, b_t, tiles, scales, widths, order=order, pdl=True)
    tiles_.lora_plan(many, slots, 16)


def _launch_fp8() -> None:
    """The FP8-weight GEMV (decode rows, PDL) and W8A16 GEMM at Qwen3-8B's qkv shape, per-row
    and 128x128 block scales."""
    from metrale.kernels import reference
    from metrale.kernels import triton_fp8 as tf

    n, k = 6144, 4096
    for block in (None, (128, 128)):
        q, s = reference.quantize_fp8(torch.randn(n, k), block)
        for m in (1, 2, 4, 8):
            tf.gemv_fp8(torch.randn(m, k, dtype=torch.bfloat16), q, s, None, block, pdl=True)
        tf.gemv_fp8_silu_mul(torch.randn(1, 2 * k, dtype=torch.bfloat16), q, s, None, block)
        for m in (16, 32, 64, 200, 300):
            tf.gemm_fp8(torch.randn(m, k, dtype=torch.bfloat16), q, s, None, block)


def _launch_ssm() -> None:
    """The recurrent-layer kernels on Nemotron-H-8B (Mamba-2) and Qwen3-Next (gated delta)
    shapes, bf16 activations, float32 state."""
    from metrale.kernels import triton_ssm as tm
    from metrale.kernels import triton_ssm_prefill as tp

    bf = torch.bfloat16
    slots = torch.arange(4, dtype=torch.int64)
    conv = torch.zeros(8, 10240, 4, dtype=bf)
    tm.causal_conv1d_update(torch.randn(4, 10240, dtype=bf), torch.randn(10240, 4, dtype=bf),
                            torch.randn(10240, dtype=bf), conv, slots, "silu")  # fmt: skip
    qsl, pre_slots, initial = [0, 40, 100], [0, 1], [False, True]
    tp.causal_conv1d_varlen(torch.randn(100, 10240, dtype=bf), torch.randn(10240, 4, dtype=bf),
                            torch.randn(10240, dtype=bf), conv, qsl, pre_slots, initial, "silu")  # fmt: skip
    ssm = torch.zeros(8, 128, 64, 128)
    heads = (torch.randn(128), torch.randn(128, dtype=bf), torch.randn(128, dtype=bf))
    tm.mamba2_state_update(torch.randn(4, 128, 64, dtype=bf), torch.randn(4, 128, dtype=bf),
                           heads[0], torch.randn(4, 8, 128, dtype=bf), torch.randn(4, 8, 128, dtype=bf),
                           heads[1], heads[2], ssm, slots)  # fmt: skip
    tp.mamba2_chunk_scan_varlen(torch.randn(100, 128, 64, dtype=bf), torch.randn(100, 128, dtype=bf),
                                heads[0], torch.randn(100, 8, 128, dtype=bf),
                                torch.randn(100, 8, 128, dtype=bf), heads[1], heads[2], (0.0, 1e4),
                                128, ssm, qsl, pre_slots, initial)  # fmt: skip
    gdn = torch.zeros(8, 32, 128, 128)
    tm.gated_delta_update(torch.randn(4, 16, 128, dtype=bf), torch.randn(4, 16, 128, dtype=bf),
                          torch.randn(4, 32, 128, dtype=bf), torch.randn(4, 32),
                          torch.rand(4, 32, dtype=bf), gdn, slots)  # fmt: skip
    tp.gated_delta_chunk_varlen(torch.randn(100, 16, 128, dtype=bf), torch.randn(100, 16, 128, dtype=bf),
                                torch.randn(100, 32, 128, dtype=bf), torch.randn(100, 32),
                                torch.rand(100, 32, dtype=bf), gdn, qsl, pre_slots, initial)  # fmt: skip


def _launch_fp8_kv() -> None:
    """The float8 KV specialisations (`KV_FP8`): writers, decode, verify, prefill; bf16
    queries, Qwen3-8B heads."""
    from metrale.kernels import triton_attention as ta
    from metrale.kernels import triton_rotary as tr
    from metrale.kernels.metadata import AttentionMetadata

    bf, fp8 = torch.bfloat16, torch.float8_e4m3fn
    tokens, hq, hk, d, blocks, block_size, rows = 8, 32, 8, 128, 64, 16, 4
    k_cache = torch.zeros(blocks, block_size, hk, d, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    scales = (torch.ones(1), torch.ones(1))
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=bf)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d :].view(tokens, hk, d)
    slots, positions = torch.arange(tokens), torch.arange(tokens)
    cos_sin, w = torch.randn(4096, 2, d // 2), torch.randn(d, dtype=bf)
    ta.write_kv(k, v, k_cache, v_cache, slots, *scales)
    cache = (k_cache, v_cache, slots, *scales)
    tr.rotary_write_kv(positions, q, k, v, cos_sin, d, *cache)
    tr.qk_norm_rotary_write_kv(positions, q, k, v, w, w, 1e-6, cos_sin, d, *cache)
    lens = torch.full((rows,), 100, dtype=torch.int32)
    tables = torch.randint(1, blocks, (rows, 16), dtype=torch.int32)
    qd = torch.randn(rows, hq, d, dtype=bf)
    for splits in (1, 8):
        ta.decode_attention(qd, k_cache, v_cache, lens, tables, 0.1, None, num_splits=splits,
                            k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    qv = torch.randn(rows * 5, hq, d, dtype=bf)
    ta.decode_attention(qv, k_cache, v_cache, lens, tables, 0.1, None, query_len=5, num_splits=8,
                        k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    meta = AttentionMetadata(
        positions=torch.arange(rows), slot_mapping=torch.arange(rows),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32) * 20, seq_lens=lens,
        block_tables=tables, num_decode=0, query_lens_host=[20] * rows,
        seq_lens_host=[100] * rows, max_query_len=20, max_seq_len=100,
    )  # fmt: skip
    qp = torch.randn(20 * rows, hq, d, dtype=bf)
    ta.prefill_attention(qp, k_cache, v_cache, meta, 0.1, None, torch.empty_like(qp), 0,
                         k_scale=scales[0], v_scale=scales[1])  # fmt: skip


def _launch_moe() -> None:
    """The MoE kernels at Qwen3-30B-A3B's expert shapes (and Mixtral's width): both paths,
    gated and plain, bf16 and fp32, the routing kernel and the GEMV with routing fused."""
    from metrale.kernels import triton_moe as tm

    for dtype, hidden, inter, experts, top_k in [
        (torch.bfloat16, 2048, 768, 128, 8),
        (torch.bfloat16, 4096, 14336, 8, 2),
        (torch.float32, 2048, 768, 128, 8),
    ]:
        for gated in (True, False):
            w_in = torch.empty(experts, (2 if gated else 1) * inter, hidden, dtype=dtype)
            w_out = torch.empty(experts, hidden, inter, dtype=dtype)
            for tokens, path in ((1, "gemv"), (64, "grouped"), (2048, "grouped")):
                x = torch.randn(tokens, hidden, dtype=dtype)
                ids = torch.randint(0, experts, (tokens, top_k))
                weights = torch.rand(tokens, top_k)
                act = "silu" if gated else "relu2"
                tm.moe_experts(x, w_in, w_out, ids, weights, gated, act, path=path)
            logits = torch.randn(1, experts, dtype=dtype)
            x = torch.randn(1, hidden, dtype=dtype)
            tm.moe_softmax_experts(x, logits, w_in, w_out, top_k, True, dtype, gated, act)
        tm.moe_softmax_topk(torch.randn(4, experts, dtype=dtype), top_k, True, dtype)


def _report() -> list[str]:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump = os.path.join(tools, "cuobjdump")
    ops = ["HGMMA", "HMMA", "LDGSTS", "LDG.E.128", "LDL", "STL"]
    lines = [f"{'kernel':<22} {'regs':>4} {'stack':>5} {'smem':>6} " + " ".join(ops) + "  config"]
    for name, kwargs, kernel in _compiled:
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
            path = f.name
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [cuobjdump, "--dump-sass", path], capture_output=True, text=True
        ).stdout
        os.unlink(path)
        m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        regs, stack = m.groups() if m else ("?", "?")
        found = [len(re.findall(re.escape(op) + r"\b", sass)) for op in ops]
        counts = " ".join(f"{n:>{len(op)}}" for n, op in zip(found, ops))
        config = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
        lines.append(
            f"{name:<22} {regs:>4} {stack:>5} {kernel.metadata.shared:>6} {counts}  {config}"
        )
    return lines


def main() -> int:
    _install()
    _launch_everything()
    for line in _report():
        print(line)  # a developer tool's output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
