"""Kernel benchmark: each Triton kernel timed on Qwen3-8B shapes against the bytes it must move
and the FLOPs it must do, with the measured copy bandwidth as the memory ceiling and the torch
reference as the peer.

Owner: bench. `python -m metrale.bench.kernels --out PATH` (CUDA only) writes one JSON dict.

Invariants:
- Times are medians of `triton.testing.do_bench` (which flushes L2 between runs); decode
  attention is also timed as a CUDA-graph replay (`do_bench_cudagraph`), the way the engine
  runs it. Inputs are random, never zeros.
- `bytes` is the minimum traffic (every input read once, every output written once);
  `bandwidth_fraction` = (bytes / time) / measured device-to-device copy bandwidth.
- The torch reference is timed where its memory use stays modest (`ref_ms`; None when
  skipped), so each kernel's speed is also a ratio to the CPU path's code run on the GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Qwen3-8B attention and MLP shapes.
HIDDEN, INTERMEDIATE = 4096, 12288
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
VOCAB = 151_936
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
#: Skip the torch reference when it would materialise more than this many bytes.
REF_BYTES_LIMIT = 4 << 30
DECODE_BATCHES = (1, 32, 128)
DECODE_CONTEXTS = (1024, 4096, 32768)
#: (query_lens, seq_lens, num_decode) of the prefill and mixed cases.
PREFILL_CASES: tuple[tuple[list[int], list[int], int], ...] = (
    ([2048], [2048], 0),
    ([2048], [2048 + 30720], 0),  # a chunk after a cached prefix
    ([512] * 4, [512] * 4, 0),
    ([1] * 64 + [1024], [4096] * 64 + [1024], 64),  # decode rows mixed with a chunk
)
ELEMENTWISE_TOKENS = (1, 128, 2048)
SAMPLING_BATCHES = (1, 64, 256)


def _median_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _graph_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


class _Recorder:
    def __init__(self, copy_bw: float) -> None:
        self.copy_bw = copy_bw
        self.rows: list[dict[str, Any]] = []

    def add(
        self,
        name: str,
        shape: dict[str, Any],
        fn: Callable[[], Any],
        nbytes: float,
        flops: float = 0.0,
        ref: Callable[[], Any] | None = None,
        graph: bool = False,
    ) -> None:
        ms = _median_ms(fn)
        row: dict[str, Any] = {
            "kernel": name,
            "shape": shape,
            "ms": ms,
            "bytes": nbytes,
            "flops": flops,
            "GBps": nbytes / ms / 1e6,
            "bandwidth_fraction": nbytes / (ms / 1e3) / self.copy_bw,
            "TFLOPs": flops / ms / 1e9 if flops else None,
        }
        if graph:
            graph_ms = _graph_ms(fn)
            row["graph_ms"] = graph_ms
            row["graph_bandwidth_fraction"] = nbytes / (graph_ms / 1e3) / self.copy_bw
        row["ref_ms"] = _median_ms(ref) if ref is not None else None
        row["speedup_vs_ref"] = row["ref_ms"] / ms if row["ref_ms"] else None
        self.rows.append(row)
        logger.info(
            "%-22s %-48s %9.4f ms %7.1f GB/s %5.1f%%  ref %s",
            name, json.dumps(shape), ms, row["GBps"], 100 * row["bandwidth_fraction"],
            f"{row['ref_ms']:.4f} ms" if row["ref_ms"] else "-",
        )  # fmt: skip


def _paged_meta(
    query_lens: list[int], seq_lens: list[int], num_decode: int, device: torch.device, g: Any
) -> Any:
    """Metadata over a shuffled block pool (fragmented tables, as a long-running server has)."""
    from metrale.kernels.metadata import AttentionMetadata

    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    total = sum(blocks)
    pool = torch.randperm(total, generator=g) + 1  # block 0 is the null block
    width = max(blocks)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = pool[at : at + n].to(torch.int32)
        at += n
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=torch.zeros(len(positions), dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_decode=num_decode,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=qsl,
    ), total + 1


def _attention_flops(query_lens: list[int], seq_lens: list[int]) -> float:
    visible = 0
    for q, s in zip(query_lens, seq_lens):
        visible += sum(s - q + i + 1 for i in range(q))
    return 4.0 * visible * Q_HEADS * HEAD_DIM


def _attention_bytes(query_lens: list[int], seq_lens: list[int]) -> float:
    elem = torch.finfo(DTYPE).bits // 8
    kv = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * elem
    qo = sum(query_lens) * Q_HEADS * HEAD_DIM * 2 * elem
    return float(kv + qo)


def _bench_attention(rec: _Recorder, device: torch.device, g: Any) -> None:
    from metrale.kernels import reference, triton_attention

    scale = HEAD_DIM**-0.5

    def blocks(seq_lens: list[int]) -> int:
        return sum(math.ceil(n / BLOCK_SIZE) for n in seq_lens)

    num_blocks = 1 + max(
        blocks([max(DECODE_CONTEXTS)] * max(DECODE_BATCHES)), *(blocks(c[1]) for c in PREFILL_CASES)
    )
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)

    def case(name: str, query_lens: list[int], seq_lens: list[int], num_decode: int) -> None:
        meta, used = _paged_meta(query_lens, seq_lens, num_decode, device, g)
        assert used <= num_blocks
        q = torch.randn(sum(query_lens), Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)

        def run() -> Any:
            return triton_attention.paged_attention(q, k_cache, v_cache, meta, scale)

        ref = None
        ref_bytes = 4 * sum(seq_lens) * KV_HEADS * HEAD_DIM * 2
        if ref_bytes <= REF_BYTES_LIMIT:

            def ref() -> Any:
                return reference.paged_attention(q, k_cache, v_cache, meta, scale)

        rec.add(
            name,
            {"query_lens": _summary(query_lens), "seq_lens": _summary(seq_lens)},
            run,
            _attention_bytes(query_lens, seq_lens),
            _attention_flops(query_lens, seq_lens),
            ref,
            graph=num_decode == len(seq_lens),
        )

    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            case("decode_attention", [1] * batch, [context] * batch, batch)
    for query_lens, seq_lens, num_decode in PREFILL_CASES:
        name = "mixed_attention" if num_decode else "prefill_attention"
        case(name, query_lens, seq_lens, num_decode)


def _summary(values: list[int]) -> Any:
    return values if len(set(values)) > 1 and len(values) <= 4 else f"{len(values)} x {values[0]}"


def _bench_elementwise(rec: _Recorder, device: torch.device) -> None:
    from metrale.kernels import reference, triton_attention, triton_norm, triton_rotary

    elem = torch.finfo(DTYPE).bits // 8
    for tokens in ELEMENTWISE_TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=device)
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, dtype=DTYPE, device=device)
        rec.add(
            "rms_norm", {"tokens": tokens, "hidden": HIDDEN},
            lambda x=x, w=w: triton_norm.rms_norm(x, w, 1e-6),
            2 * x.numel() * elem, ref=lambda x=x, w=w: reference.rms_norm(x, w, 1e-6),
        )  # fmt: skip
        rec.add(
            "add_rms_norm", {"tokens": tokens, "hidden": HIDDEN},
            lambda x=x, r=r, w=w: triton_norm.add_rms_norm(x, r, w, 1e-6),
            4 * x.numel() * elem, ref=lambda x=x, r=r, w=w: reference.add_rms_norm(x, r, w, 1e-6),
        )  # fmt: skip
        gu = torch.randn(tokens, 2 * INTERMEDIATE, dtype=DTYPE, device=device)
        rec.add(
            "silu_and_mul", {"tokens": tokens, "intermediate": INTERMEDIATE},
            lambda gu=gu: triton_norm.silu_and_mul(gu),
            1.5 * gu.numel() * elem, ref=lambda gu=gu: reference.silu_and_mul(gu),
        )  # fmt: skip
        qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=device)
        q = qkv[:, : Q_HEADS * HEAD_DIM].view(tokens, Q_HEADS, HEAD_DIM)
        k = qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + KV_HEADS) * HEAD_DIM].view(
            tokens, KV_HEADS, HEAD_DIM
        )
        v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
        positions = torch.randint(0, 32768, (tokens,), device=device)
        cos_sin = torch.randn(32768, 2, HEAD_DIM // 2, device=device)
        qw = torch.randn(HEAD_DIM, dtype=DTYPE, device=device)
        kw = torch.randn(HEAD_DIM, dtype=DTYPE, device=device)
        qk_bytes = 2 * tokens * (Q_HEADS + KV_HEADS) * HEAD_DIM * elem + tokens * HEAD_DIM * 4
        rec.add(
            "qk_norm_rotary", {"tokens": tokens, "heads": [Q_HEADS, KV_HEADS], "dim": HEAD_DIM},
            lambda q=q, k=k, p=positions, cs=cos_sin, qw=qw, kw=kw: triton_rotary.qk_norm_rotary(
                p, q, k, qw, kw, 1e-6, cs, HEAD_DIM),
            qk_bytes,
            ref=lambda q=q, k=k, p=positions, cs=cos_sin, qw=qw, kw=kw: reference.qk_norm_rotary(
                p, q, k, qw, kw, 1e-6, cs, HEAD_DIM),
        )  # fmt: skip
        slots = torch.randperm(tokens * 64, device=device)[:tokens]
        kc = torch.randn(tokens * 4 + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        vc = torch.randn_like(kc)
        rec.add(
            "write_kv", {"tokens": tokens, "kv_heads": KV_HEADS, "dim": HEAD_DIM},
            lambda k=k, v=v, kc=kc, vc=vc, s=slots: triton_attention.write_kv(k, v, kc, vc, s),
            4 * tokens * KV_HEADS * HEAD_DIM * elem,
            ref=lambda k=k, v=v, kc=kc, vc=vc, s=slots: reference.write_kv(k, v, kc, vc, s),
        )  # fmt: skip


def _bench_sampling(rec: _Recorder, device: torch.device, g: Any) -> None:
    from metrale.kernels import reference, triton_sampling

    for batch in SAMPLING_BATCHES:
        logits = (torch.randn(batch, VOCAB, generator=g) * 2.5).to(device)
        logits[:, :8] += 8.0  # a peaked head, as real next-token distributions have
        nbytes = logits.numel() * 4
        rec.add(
            "argmax", {"batch": batch, "vocab": VOCAB},
            lambda x=logits: triton_sampling.argmax(x), nbytes,
            ref=lambda x=logits: reference.argmax(x),
        )  # fmt: skip
        for top_k, top_p in ((50, 0.9), (0, 0.95), (20, 1.0)):
            ks = torch.full((batch,), top_k, dtype=torch.int64, device=device)
            ps = torch.full((batch,), top_p, dtype=torch.float32, device=device)
            u = torch.rand(batch, dtype=torch.float64, device=device)
            rec.add(
                "top_k_top_p_sample",
                {"batch": batch, "vocab": VOCAB, "top_k": top_k, "top_p": top_p},
                lambda x=logits, ks=ks, ps=ps, u=u: triton_sampling.top_k_top_p_sample(
                    x, ks, ps, u),
                nbytes,
                ref=lambda x=logits, ks=ks, ps=ps, u=u: reference.top_k_top_p_sample(
                    x, ks, ps, u),
            )  # fmt: skip


def run_kernel_bench(out_path: str | Path) -> dict[str, Any]:
    """Time every Triton kernel on CUDA and write the JSON dict to `out_path` (returned too).

    Raises RuntimeError without CUDA or triton: there is nothing meaningful to time.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA device (none is available)")
    try:
        import triton
    except ImportError as exc:
        raise RuntimeError(f"the kernel benchmark needs triton ({exc})") from exc
    from metrale.bench.hardware import copy_bandwidth
    from metrale.bench.record import git_commit

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    copy_bw = copy_bandwidth(device)
    logger.info("device-to-device copy bandwidth: %.1f GB/s", copy_bw / 1e9)
    rec = _Recorder(copy_bw)
    _bench_attention(rec, device, g)
    torch.cuda.empty_cache()
    _bench_elementwise(rec, device)
    _bench_sampling(rec, device, g)
    result = {
        "instrument": "kernels",
        "device": torch.cuda.get_device_name(device),
        "commit": git_commit(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "model_shape": "Qwen3-8B (32 q / 8 kv heads, head_dim 128, hidden 4096, bf16)",
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "kernels": rec.rows,
    }
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'kernel':<20} {'shape':<58} {'ms':>9} {'%bw':>6} {'graph%':>6} {'x ref':>7}"]
    for row in result["kernels"]:
        graph = row.get("graph_bandwidth_fraction")
        speedup = row["speedup_vs_ref"]
        lines.append(
            f"{row['kernel']:<20} {json.dumps(row['shape'])[:58]:<58} {row['ms']:>9.4f} "
            f"{100 * row['bandwidth_fraction']:>6.1f} "
            f"{'' if graph is None else f'{100 * graph:.1f}':>6} "
            f"{'' if speedup is None else f'{speedup:.2f}':>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/records/kernels.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = run_kernel_bench(args.out)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 2
    logger.info("%s", _table(result))
    logger.info("copy bandwidth %.0f GB/s; written to %s", result["copy_bandwidth_GBps"], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
