"""`metrale bench kv-tiers`: time to first token of a long prefix brought back from the prefix
cache's host tier and, after a restart, from its disk tier, against a cold prefill; the disk's
own bandwidth; and decode tok/s with high-speed swap against the fully resident run.

Owner: bench. The page-cache drop and the disk probe are `disk.py`'s.

Method (one engine, then a second one on the same disk directory):
- The device KV pool holds ~1.5 prompts (`num_kv_blocks`), so a second long prompt evicts the
  first's blocks; the host tier holds `--host-prompts` prompts' KV; the disk tier lives in a
  temporary directory (`--disk-dir` to choose where).
- Before every timed request the bench evicts (untimed, through the engine's own reclaim) until
  the request's blocks are free, and waits for the disk tier's background writes, so no timed
  request pays for evicting another's blocks or shares the disk with a write.
- Cold: a fresh random prompt, nothing of it cached. Host: prompt P runs, two other prompts
  push its blocks out of the device pool; the bench checks with the tier's index (P's chain
  keys) that every block is in the host tier and none is matched on the device, then times
  P plus one token (`num_cached_tokens` recorded). Disk: prompts Q_i run, enough other traffic
  pushes them through the host tier to disk (checked the same way), the engine is dropped
  (its disk writer flushed, CUDA memory freed), the page cache is emptied (fsync, then
  `posix_fadvise(DONTNEED)` on every block file, then `/proc/sys/vm/drop_caches` where
  writable; the record says which worked), a new engine indexes the directory, and Q_i plus
  one token is timed against a cold prompt on that engine.
- Disk bandwidth: a `--disk-probe-mb` file written in 8 MiB chunks and fsynced (write), then
  dropped from the page cache the same way and read back (read).
- Restore bandwidth: bytes restored per tier over the host wall time of the restore loop
  (the tier stats `restore_bytes` / `restore_seconds`).
- High-speed swap: on `--hss-device` (default cpu) with `--hss-config-dir`: batch-1 decode
  tok/s over a `--hss-context-tokens` context (default 8x the resident window), with
  high-speed swap (a pool of about two windows; eager on CUDA, where each layer gathers its
  host blocks) and fully resident (graphs on CUDA; no prefix cache on either), and whether
  their greedy tokens are identical.
Figures are medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from metrale.bench.disk import disk_bandwidth, drop_page_cache
from metrale.bench.flags import add_flags, add_model_flags
from metrale.bench.record import write_record
from metrale.bench.synthetic import prepare_model_dir
from metrale.bench.ttft import time_to_first_token
from metrale.cache.block_pool import blocks_for
from metrale.cache.kv_tiers import KvTiers, chain_keys
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


def make_room(engine: Engine, tokens: int) -> None:
    """Evict cached blocks (into the tiers) until a `tokens`-token prompt's blocks are free."""
    model = engine.model
    need = blocks_for(tokens + 1, model.kv_block_size()) + 1
    short = need - model.num_free_blocks()
    if short > 0:
        model.reclaim_prefix_blocks(short)


def run_prompt(engine: Engine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()


def timed(engine: Engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    make_room(engine, len(prompt))
    tiers_of(engine).flush()  # no disk-tier write runs beside a timed request
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    return time_to_first_token(engine, request_id, prompt)


def tiers_of(engine: Engine) -> KvTiers:
    tiers = engine.model.kv_tiers
    if tiers is None:
        raise RuntimeError("the engine has no KV tiers (kv_offload_host_gb / kv_offload_disk)")
    return tiers


def where(engine: Engine, prompt: list[int]) -> dict[str, int]:
    """How many of `prompt`'s full blocks the device prefix cache matches, and how many the
    host and disk tiers hold."""
    model = engine.model
    tiers = tiers_of(engine)
    bs = model.kv_block_size()
    keys = chain_keys(prompt, bs, 0)
    return {
        "device": model.prefix_match_len(prompt, 0) // bs,
        "host": sum(k in tiers.host.items for k in keys),
        "disk": sum(tiers.disk is not None and tiers.disk.contains(k) for k in keys),
        "blocks": len(keys),
    }


def tier_stats(engine: Engine) -> dict[str, int]:
    return {k: v for k, v in engine.model.prefix_cache_stats().items() if k.startswith("offload")}


def free_memory() -> float:
    """Collect the dropped engine and return its cached CUDA memory; GiB still allocated."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30


def _restore_gb_s(before: dict[str, int], after: dict[str, int], tier: str) -> float | None:
    moved = after[f"offload_{tier}_restore_bytes"] - before[f"offload_{tier}_restore_bytes"]
    us = after[f"offload_{tier}_restore_us"] - before[f"offload_{tier}_restore_us"]
    return moved / us / 1e3 if us > 0 else None


def block_payload_bytes(model_dir: Path, block_size: int, dtype: str) -> int:
    """One KV block of every layer (K and V), from the checkpoint's config: what a tier keeps."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return cfg["num_hidden_layers"] * 2 * block_size * heads * head_dim * elem


def tiers_part(args: argparse.Namespace, disk_dir: Path) -> dict[str, Any]:
    model_dir = prepare_model_dir(args.config_dir)
    n = args.prompt_len
    block_size = 16
    blocks_per_prompt = blocks_for(n + 1, block_size)
    base = dict(
        model=str(model_dir), device=args.device, dtype=args.dtype, load_format="dummy",
        max_num_batched_tokens=n + 16, max_model_len=n + 16, block_size=block_size,
        num_kv_blocks=blocks_per_prompt * 3 // 2 + 2, max_num_seqs=4,
        kv_offload_disk=str(disk_dir), kv_offload_disk_gb=args.disk_gb,
    )  # fmt: skip
    dtype = (
        args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
    )
    payload = block_payload_bytes(model_dir, block_size, dtype)
    host_gb = args.host_prompts * blocks_per_prompt * payload / 2**30
    config = EngineConfig(**base, kv_offload_host_gb=host_gb)
    start = time.perf_counter()
    engine = Engine(config)
    load_s = time.perf_counter() - start
    actual = len(engine.model.kv_cache.block_bytes(1))
    if actual != payload:
        raise RuntimeError(f"a KV block is {actual} bytes, the bench sized its tiers for {payload}")
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(0)

    def fresh(length: int = n) -> list[int]:
        return torch.randint(8, vocab, (length,), generator=gen).tolist()

    # Warm-up: a full-length prompt, then its restore from the host tier (one-time costs of
    # both paths: kernels, the pinned staging buffers).
    warm = fresh()
    time_to_first_token(engine, "warmup", warm)
    engine.model.reclaim_prefix_blocks(engine.model.num_total_blocks())
    time_to_first_token(engine, "warmup-host", [*warm, 7])
    cold, host, host_cached, placement = [], [], [], []
    before = tier_stats(engine)
    for i in range(args.repeats):
        t, hit = timed(engine, f"cold-{i}", fresh())
        cold.append(t)
        assert hit == 0, f"a fresh prompt hit {hit} cached tokens"
        p = fresh()
        run_prompt(engine, f"p-{i}", p)
        for j in range(2):  # two prompts' worth of other traffic evicts every block of P
            make_room(engine, n)
            run_prompt(engine, f"fill-{i}-{j}", fresh())
        at = where(engine, p)
        placement.append(at)
        if at["device"] != 0 or at["host"] != at["blocks"]:
            raise RuntimeError(f"P is not wholly in the host tier before its reuse: {at}")
        t, hit = timed(engine, f"host-{i}", [*p, 7])
        host.append(t)
        host_cached.append(hit)
    after = tier_stats(engine)
    host_restore = _restore_gb_s(before, after, "host")

    # Disk: Q_i pushed through the host tier onto disk, then a restart.
    qs = [fresh() for _ in range(args.repeats)]
    warm = fresh()  # goes to disk ahead of the Q_i: the restarted engine's warm-up reads it
    run_prompt(engine, "warmup-disk", warm)
    for i, q in enumerate(qs):
        make_room(engine, n)
        run_prompt(engine, f"q-{i}", q)
    for j in range(args.host_prompts + 3):
        make_room(engine, n)
        run_prompt(engine, f"spill-{j}", fresh())
    tiers_of(engine).flush()
    disk_placement = [where(engine, q) for q in qs]
    for at in disk_placement:
        if at["disk"] != at["blocks"]:
            raise RuntimeError(f"Q is not wholly on disk before the restart: {at}")
    stats_a = tier_stats(engine)
    tiers_of(engine).close()
    del engine
    allocated_after_drop = free_memory()
    files = sorted(disk_dir.glob("*.kvb"))
    page_cache = drop_page_cache(files, not args.no_drop_caches)
    start = time.perf_counter()
    engine = Engine(config)
    restart_s = time.perf_counter() - start
    indexed = tiers_of(engine).stats.disk.blocks
    time_to_first_token(engine, "warmup", [*warm, 7])
    cold_b, disk, disk_cached = [], [], []
    before = tier_stats(engine)
    for i, q in enumerate(qs):
        t, hit = timed(engine, f"cold-b-{i}", fresh())
        cold_b.append(t)
        t, hit = timed(engine, f"disk-{i}", [*q, 7])
        disk.append(t)
        disk_cached.append(hit)
    after = tier_stats(engine)
    disk_restore = _restore_gb_s(before, after, "disk")
    disk_hits = after["offload_disk_hits"] - before["offload_disk_hits"]
    tiers_of(engine).close()
    del engine
    free_memory()

    med = statistics.median
    return {
        "block_bytes": payload,
        "prompt_kv_bytes": payload * (n // block_size),
        "device_pool_blocks": config.num_kv_blocks,
        "host_tier_gb": host_gb,
        "load_s": load_s,
        "restart_load_s": restart_s,
        "cuda_gib_allocated_after_drop": allocated_after_drop,
        "restart_indexed_blocks": indexed,
        "cold_ttft_ms": 1000 * med(cold),
        "host_ttft_ms": 1000 * med(host),
        "host_over_cold": med(host) / med(cold),
        "host_cached_tokens": med(host_cached),
        "host_restore_gb_s": host_restore,
        # What restoring one prefix's KV took at that bandwidth (part of host_ttft_ms).
        "host_restore_ms_per_prefix": _ms(payload * (n // block_size), host_restore),
        "host_placement_before_reuse": placement[-1],
        "restart_cold_ttft_ms": 1000 * med(cold_b),
        "disk_ttft_ms": 1000 * med(disk),
        "disk_over_cold": med(disk) / med(cold_b),
        "disk_cached_tokens": med(disk_cached),
        "disk_hits_blocks": disk_hits,
        "disk_restore_gb_s": disk_restore,
        "disk_restore_ms_per_prefix": _ms(payload * (n // block_size), disk_restore),
        "disk_placement_before_restart": disk_placement[-1],
        "page_cache_before_restart": page_cache,
        "tier_stats_before_restart": stats_a,
        "samples_ms": {
            "cold": [1000 * t for t in cold],
            "host": [1000 * t for t in host],
            "restart_cold": [1000 * t for t in cold_b],
            "disk": [1000 * t for t in disk],
        },
    }


def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Batch-1 decode tok/s after the first token, and the greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    engine.add_request("hss", prompt, params)
    first = None
    out_tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            out_tokens = list(out.outputs[0].token_ids)
            if first is None and out_tokens:
                first = (time.perf_counter(), len(out_tokens))
    assert first is not None
    return (len(out_tokens) - first[1]) / (time.perf_counter() - first[0]), out_tokens


def hss_part(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = prepare_model_dir(args.hss_config_dir)
    window = args.hss_window_blocks
    block_size = 16
    context = args.hss_context_tokens or 8 * (1 + window) * block_size
    prompt_len = context - args.hss_decode_tokens
    cuda = args.hss_device == "cuda"
    base = dict(
        model=str(model_dir), device=args.hss_device, load_format="dummy",
        dtype="bfloat16" if cuda else "float32", max_model_len=context + 16,
        enable_prefix_caching=False, block_size=block_size, max_num_seqs=1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    resident_engine = Engine(EngineConfig(**base, num_kv_blocks=context // block_size + 8))
    prompt = torch.randint(8, resident_engine.vocab_size, (prompt_len,), generator=gen).tolist()
    pool = 2 * (1 + window) + 4  # far below the context's blocks
    hss_engine = Engine(
        EngineConfig(**base, num_kv_blocks=pool, high_speed_swap=True,
                     high_speed_swap_blocks_per_seq=window),
        max_prefill_chunk=window * block_size,
    )  # fmt: skip
    rates: dict[str, list[float]] = {"resident": [], "hss": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, engine in (("resident", resident_engine), ("hss", hss_engine)):
            rate, toks = decode_rate(engine, prompt, args.hss_decode_tokens)
            rates[name].append(rate)
            tokens[name] = toks
    hss = hss_engine.model.hss
    assert hss is not None
    med = statistics.median
    return {
        "device": args.hss_device,
        "dtype": base["dtype"],
        "host_block_reads": hss.host_block_reads,
        "shape": Path(args.hss_config_dir).name,
        "context_tokens": context,
        "window_tokens": (1 + window) * block_size,
        "device_pool_blocks_hss": pool,
        "context_blocks": context // block_size,
        "decode_tokens": args.hss_decode_tokens,
        "resident_decode_tok_s": med(rates["resident"]),
        "hss_decode_tok_s": med(rates["hss"]),
        "hss_over_resident": med(rates["hss"]) / med(rates["resident"]),
        "tokens_identical": tokens["hss"] == tokens["resident"],
        "host_blocks_stored": hss.stored_blocks,
        "threads": torch.get_num_threads(),
    }


def run(args: argparse.Namespace) -> dict:
    if args.disk_dir:
        root = Path(args.disk_dir)
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="metrale-kvtiers-", dir=root))
    else:
        work = Path(tempfile.mkdtemp(prefix="metrale-kvtiers-"))
    try:
        disk = disk_bandwidth(work, args.disk_probe_mb, not args.no_drop_caches)
        tiers = tiers_part(args, work / "tier")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    hss: dict[str, Any] | None = None
    if args.hss_decode_tokens > 0:
        try:
            hss = hss_part(args)
        except Exception as exc:  # the tier figures are still recorded; the failure is named
            logger.exception("high-speed swap part failed")
            hss = {"error": f"{type(exc).__name__}: {exc}"}
    figures = {**tiers, "disk": disk, "high_speed_swap": hss}
    shape = args.shape or Path(args.config_dir).name
    path = write_record(
        "kv-tiers",
        model_shape=shape,
        config={
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "device": args.device,
            "dtype": args.dtype,
            "config_dir": str(args.config_dir),
            "host_prompts": args.host_prompts,
            "disk_gb": args.disk_gb,
            "disk_dir_parent": str(work.parent),
            "hss_config_dir": str(args.hss_config_dir),
            "hss_window_blocks": args.hss_window_blocks,
            "hss_device": args.hss_device,
            "threads": torch.get_num_threads(),
        },
        figures=figures,
        device=args.device,
        out_dir=args.out_dir,
        notes="peers: cold prefill on the same engine (host) and on the restarted engine (disk); "
        "timed requests find their blocks free (evictions to the tiers happen before the clock "
        "starts, and are not in any TTFT); high-speed swap against the fully resident run, on "
        "the CPU (not built on CUDA)" + (f"; {args.notes}" if args.notes else ""),
    )
    print(
        f"cold TTFT {tiers['cold_ttft_ms']:.1f} ms; host tier {tiers['host_ttft_ms']:.1f} ms "
        f"({tiers['host_over_cold']:.3f}x, {tiers['host_cached_tokens']:.0f} cached); "
        f"after restart cold {tiers['restart_cold_ttft_ms']:.1f} ms, disk "
        f"{tiers['disk_ttft_ms']:.1f} ms ({tiers['disk_over_cold']:.3f}x, "
        f"{tiers['disk_cached_tokens']:.0f} cached)"
    )
    fs = disk["filesystem"]
    if fs["type"] in ("tmpfs", "ramfs"):
        print(f"WARNING: the disk tier sat on {fs['type']} ({fs['mount']}): memory, not a disk")
    print(
        f"disk ({fs['type']} {fs['source']} on {fs['mount']}): "
        f"write {disk['write_gb_s']:.2f} GB/s, read {disk['read_gb_s']:.2f} GB/s "
        f"({disk['method']}); restore: host {_gb(tiers['host_restore_gb_s'])}, disk "
        f"{_gb(tiers['disk_restore_gb_s'])}; page cache before restart: "
        f"{tiers['page_cache_before_restart']}"
    )
    if hss is not None and "error" in hss:
        print(f"high-speed swap part FAILED: {hss['error']}")
    elif hss is not None:
        print(
            f"high-speed swap ({hss['device']}, {hss['shape']}, {hss['context_tokens']}-token "
            f"context, {hss['window_tokens']}-token window): {hss['hss_decode_tok_s']:.1f} tok/s "
            f"vs resident {hss['resident_decode_tok_s']:.1f} ({hss['hss_over_resident']:.2f}x), "
            f"tokens identical: {hss['tokens_identical']}"
        )
    print(f"record: {path}")
    return figures


def _ms(nbytes: int, gb_s: float | None) -> float | None:
    return None if not gb_s else nbytes / gb_s / 1e6


def _gb(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} GB/s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(
        parser, config_dir="bench/configs/tiny-2k", shape_help="model shape name for the record",
        device="cpu", dtype="float32",
    )  # fmt: skip
    add_flags(parser, {"--prompt-len": 1024, "--repeats": 3})
    parser.add_argument("--host-prompts", type=int, default=4,
                        help="host tier size, in prompts' KV")  # fmt: skip
    parser.add_argument("--disk-gb", type=float, default=16.0, help="disk tier size")
    parser.add_argument("--disk-dir", default=None,
                        help="parent of the temporary disk-tier directory (default: $TMPDIR)")  # fmt: skip
    parser.add_argument("--disk-probe-mb", type=int, default=1024,
                        help="size of the disk bandwidth probe file")  # fmt: skip
    parser.add_argument("--no-drop-caches", action="store_true",
                        help="skip /proc/sys/vm/drop_caches (fadvise DONTNEED on the files only)")  # fmt: skip
    parser.add_argument("--hss-config-dir", default="bench/configs/tiny-2k")
    parser.add_argument("--hss-window-blocks", type=int, default=8)
    parser.add_argument("--hss-device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--hss-context-tokens", type=int, default=0,
                        help="high-speed swap context (0: 8x the resident window)")  # fmt: skip
    parser.add_argument("--hss-decode-tokens", type=int, default=128,
                        help="decode tokens timed per run (0 skips high-speed swap)")  # fmt: skip
    parser.add_argument("--out-dir", default="bench/records")
    parser.add_argument("--notes", default="", help="appended to the record's notes")
