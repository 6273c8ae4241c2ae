"""Sweep the launch configurations of the small-batch GEMV kernels that miss their bandwidth
(issue 22's FP8 GEMV, issue 23's MoE expert GEMVs) on the shapes that matter, and print the
best per shape against the configuration the library picks today.

Usage (GPU): PYTHONPATH=. python3 tools/sweep_gemv_configs.py [--out sweep.json] [--only fp8|moe]

Each candidate is timed as `tools/bench_gemv.time_per_call` times a kernel: a CUDA graph of
calls rotating over enough weight copies that L2 never holds them. Candidates that do not
compile (registers, shared memory) are skipped and counted. A developer tool: its output
decides the tables in `triton_fp8.gemv_config` and `triton_moe._gemv_blocks`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import bench_gemv as bg

from metrale.kernels import reference
from metrale.kernels import triton_fp8 as tf
from metrale.kernels import triton_moe as tm

FP8_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288)}  # fmt: skip
FP8_TILES = [(8, 512), (16, 512), (32, 512), (8, 1024), (16, 1024), (32, 1024), (8, 2048),
             (16, 2048), (64, 256), (32, 256)]  # fmt: skip
#: Qwen3-30B-A3B's experts: hidden 2048, intermediate 768, 128 experts, 8 routed.
MOE = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
M_ROWS = (1,)
MOE_TILES = [(4, 512), (8, 512), (16, 512), (8, 256), (16, 256), (32, 256), (4, 1024),
             (8, 1024), (16, 1024), (32, 128), (64, 128)]  # fmt: skip


def _copies(n: int, k: int, dtype: torch.dtype, count_bytes: int) -> list[torch.Tensor]:
    count = max(2, -(-bg.ROTATE_BYTES // count_bytes))
    return [torch.randn(n, k, device="cuda").mul_(k**-0.5).to(dtype) for _ in range(count)]


def _time(fn: Any, weights: list[Any]) -> float | None:
    try:
        return bg.time_per_call(fn, weights)
    except Exception as exc:
        print(f"    skipped: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def _fp8_call(
    x: torch.Tensor, out: torch.Tensor, scales: dict[int, torch.Tensor],
    config: tuple[int, int, int, int],
) -> Any:  # fmt: skip
    """One FP8 GEMV launch with per-row scales at `config` = (BLOCK_N, BLOCK_K, warps, stages)."""
    bn, bk, warps, stages = config
    m, k = x.shape
    n = out.shape[1]

    def call(q: torch.Tensor) -> None:
        tf._gemv_fp8_kernel[(triton.cdiv(n, bn),)](
            x, q, scales[id(q)], out, out, n, k, x.stride(0), q.stride(0), 0, n, k,
            M=m, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, EVEN_K=k % bk == 0,
            HAS_BIAS=False, ACT=False, BLOCK_SCALE=False, BO=bn, BI=1, G=0,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return call


def sweep_fp8(copy_gbps: float) -> list[dict[str, Any]]:
    rows = []
    for name, (n, k) in FP8_SHAPES.items():
        w16 = _copies(n, k, torch.bfloat16, n * k)
        pairs = [reference.quantize_fp8(w, None) for w in w16]
        del w16
        scales = {id(q): s for q, s in pairs}
        weights = [q for q, _ in pairs]
        for m in M_ROWS:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            base = _time(lambda q, x=x, sc=scales: tf.gemv_fp8(x, q, sc[id(q)]), weights)
            now = tf.gemv_config(m, k, None)
            print(f"{name} M={m} library {now}: {base * 1e6:.2f} us")
            best = (base, now)
            for (bn, bk), warps, stages in itertools.product(FP8_TILES, (4, 8), (3, 5)):
                if m * bn * bk > 2 * tf._ACC_BUDGET * warps // 4 or bk > k:
                    continue
                out = torch.empty((m, n), dtype=x.dtype, device="cuda")
                call = _fp8_call(x, out, scales, (bn, bk, warps, stages))
                t = _time(call, weights)
                if t is None:
                    continue
                rows.append(dict(kind="fp8", shape=name, m=m, block_n=bn, block_k=bk,
                                 warps=warps, stages=stages, us=t * 1e6,
                                 pct_copy=n * k / t / 1e9 / copy_gbps))  # fmt: skip
                if t < best[0]:
                    best = (t, (bn, bk, stages, warps))
            print(f"{name} M={m} best {best[1]}: {best[0] * 1e6:.2f} us "
                  f"({n * k / best[0] / 1e9 / copy_gbps:.1%} copy; library {base * 1e6:.2f})")  # fmt: skip
        del weights, pairs, scales
    return rows


def _moe_call(which: str, ops: tuple[torch.Tensor, ...], config: tuple[int, ...]) -> Any:
    """One expert GEMV launch (`up`: gate/up with SiLU, `down`) at `config` = (BLOCK_N,
    BLOCK_K, warps, stages); `ops` = (x, h, y, ids)."""
    x, h, y, ids = ops
    bn, bk, warps, stages = config
    top_k, inter = h.shape
    hidden = y.shape[1]

    def up(w: torch.Tensor) -> None:
        tm._gemv_up_kernel[(top_k, triton.cdiv(inter, bn))](
            x, w, ids, h, x, x, inter, hidden, x.stride(0), w.stride(0), w.stride(1),
            h.stride(0), 1, 0,
            TOPK=top_k, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=hidden % bk == 0, GATED=True, ACT=0,
            STAGES=stages, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    def down(w: torch.Tensor) -> None:
        tm._gemv_down_kernel[(top_k, triton.cdiv(hidden, bn))](
            h, w, ids, y, hidden, inter, h.stride(0), w.stride(0), w.stride(1), y.stride(0),
            BLOCK_N=bn, BLOCK_K=bk, EVEN_K=inter % bk == 0, STAGES=stages,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return up if which == "up" else down


def sweep_moe(copy_gbps: float) -> list[dict[str, Any]]:
    hidden, inter, experts, top_k = (MOE[k] for k in ("hidden", "inter", "experts", "top_k"))
    bf = torch.bfloat16
    per = experts * 3 * inter * hidden * 2
    count = max(2, -(-bg.ROTATE_BYTES // per))
    w_ins = [torch.randn(experts, 2 * inter, hidden, device="cuda").mul_(0.02).to(bf)
             for _ in range(count)]  # fmt: skip
    w_outs = [torch.randn(experts, hidden, inter, device="cuda").mul_(0.03).to(bf)
              for _ in range(count)]  # fmt: skip
    x = torch.randn(1, hidden, device="cuda").to(bf)
    ids = torch.randperm(experts, device="cuda")[:top_k].view(1, top_k).contiguous()
    h = torch.empty((top_k, inter), dtype=bf, device="cuda")
    y = torch.empty((top_k, hidden), dtype=bf, device="cuda")
    up_bytes, down_bytes = top_k * 2 * inter * hidden * 2, top_k * inter * hidden * 2
    rows = []
    for which, total in (("up", up_bytes), ("down", down_bytes)):
        now = tm._gemv_blocks(bf, which == "up", hidden if which == "up" else inter)
        results = []
        for (bn, bk), warps, stages in itertools.product([*MOE_TILES, now], (4, 8), (2, 3)):
            limit = hidden if which == "up" else triton.next_power_of_2(inter)
            if bk > limit:
                continue
            ops = (x, h, y, ids)
            call = _moe_call(which, ops, (bn, bk, warps, stages))
            weights = w_ins if which == "up" else w_outs
            t = _time(call, weights)
            if t is None:
                continue
            tag = "library" if ((bn, bk), warps, stages) == (now, 4, 3) else ""
            results.append((t, bn, bk, warps, stages, tag))
            rows.append(dict(kind="moe", shape=which, block_n=bn, block_k=bk, warps=warps,
                             stages=stages, us=t * 1e6, library=bool(tag),
                             pct_copy=total / t / 1e9 / copy_gbps))  # fmt: skip
        results.sort()
        for t, bn, bk, warps, stages, tag in results[:6] + [r for r in results if r[5]]:
            print(f"moe {which} BLOCK_N={bn} BLOCK_K={bk} warps={warps} stages={stages}: "
                  f"{t * 1e6:.2f} us {total / t / 1e9 / copy_gbps:.1%} copy {tag}")  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", choices=("fp8", "moe"), default=None)
    args = parser.parse_args()
    copy_gbps = bg.copy_bandwidth()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    rows: list[dict[str, Any]] = []
    if args.only in (None, "moe"):
        rows += sweep_moe(copy_gbps)
    if args.only in (None, "fp8"):
        rows += sweep_fp8(copy_gbps)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(copy_gbps=copy_gbps, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
