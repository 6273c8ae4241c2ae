"""Where an MTP propose's time goes on a config shape (dummy weights): the graph replay alone
against the whole `mtp_propose` call, next to a decode and a verify step of the same rows.

Usage: python3 tools/profile_mtp.py --config-dir bench/configs/qwen3-8b [--k 4] [--batches 1,32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from metrale.bench.record import write_record
from metrale.bench.spec_cost import with_mtp_layer
from metrale.bench.synthetic import prepare_model_dir
from metrale.config import EngineConfig
from metrale.model_engine.factory import load_model


def timed(fn: Callable[[], None], iters: int) -> float:
    """Milliseconds a call, synchronized, after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1000


def profile_batch(model: Any, runner: Any, b: int, args: argparse.Namespace) -> dict[str, float]:
    seqs = [model.alloc_sequence() for _ in range(b)]
    g = torch.Generator().manual_seed(b)
    for s in seqs:
        ids = torch.randint(10, 1000, (args.context,), generator=g).tolist()
        model.prefill_chunk(ids, s, 0, len(ids), True)
    model.mtp_propose(seqs, [5] * b, [args.k] * b)  # eager: the prompt rows
    k = args.k

    def decode() -> None:
        model.decode_batch([5] * b, seqs)
        for s in seqs:
            model.commit_accepted_prefix(s, 0, 1)  # back one token

    def verify() -> None:
        model.mixed_verify_batch([5] * b, [[6] * k] * b, seqs, [])
        for s in seqs:
            model.commit_accepted_prefix(s, 1, k)  # keeps 2 rows
            model.commit_accepted_prefix(s, 0, 2)  # back to the start

    def propose() -> None:
        model.decode_batch([5] * b, seqs)  # one pending row each
        model.mtp_propose(seqs, [6] * b, [k] * b)
        for s in seqs:
            model.commit_accepted_prefix(s, 0, 1)

    d = timed(decode, args.iters)
    v = timed(verify, args.iters)
    p = timed(propose, args.iters) - d
    graph = runner.graphs[next(r for r in runner.rungs if r >= b)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay = start.elapsed_time(end) / args.iters
    for s in seqs:
        model.free_sequence(s)
    return {"decode_ms": d, "verify_ms": v, "propose_ms": p, "replay_ms": replay}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--out-dir", default="bench/records")
    args = ap.parse_args()
    path = str(with_mtp_layer(prepare_model_dir(args.config_dir)))
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(
        model=path, device="cuda", load_format="dummy", max_num_seqs=max(batches),
        max_model_len=args.context + 256,
        speculative_config={"method": "mtp", "num_speculative_tokens": args.k, "gate": "off"},
        gpu_memory_utilization=0.5,
    )  # fmt: skip
    model, _ = load_model(config, path)
    runner = model.mtp_graphs[args.k]
    out = {}
    for b in batches:
        out[b] = profile_batch(model, runner, b, args)
        print(b, {k: round(x, 3) for k, x in out[b].items()}, flush=True)
    print(json.dumps(out))
    path_out = write_record(
        "mtp-profile",
        model_shape=args.shape or Path(args.config_dir).name,
        config={"k": args.k, "batches": batches, "context": args.context, "iters": args.iters,
                "weights": "dummy", "graphs": "decode, verify and MTP propose graphs"},
        figures=out,
        device="cuda",
        out_dir=args.out_dir,
        notes="decode_ms / verify_ms: one forward of the rows (decode; k drafts); propose_ms: "
        "the whole mtp_propose call (staging, graph, read back) after a decode step; "
        "replay_ms: the MTP propose graph alone (catch-up + k - 1 head steps, argmaxes)",
    )  # fmt: skip
    print(f"record: {path_out}")


if __name__ == "__main__":
    main()
