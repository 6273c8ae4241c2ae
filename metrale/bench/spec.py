"""`metrale bench spec`: what speculative decoding buys on real text.

Owner: bench.

`spec` (CPU by default, `--device` otherwise; the bundled model): two workloads on held-out
code, functions from modules the model never saw (`HELD_OUT`, the model card's). `edit` (the
default) asks for a function again after a one-line change, so the answer repeats text of the
prompt; each prompt is sent twice (the second time as another request, as agents re-send
files). `continue` gives the first half of a function to continue (nothing to copy: what the
MTP head is for). The same requests run with speculation off and with each of `--methods`
(`ngram`, `suffix`, `mtp`, `draft_model` with `--draft-model DIR`), one engine each, in one
process:
wall time, output tokens per decode step, acceptance rate, mean acceptance length, and the
speedup over off, acceptance per draft position. Greedy outputs must be identical in every
mode; the record says whether they were.

The verify-cost instrument, `spec-cost`, is `spec_cost.py`.
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from metrale.bench.record import write_record
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.sampling.params import SamplingParams

#: Held-out modules of the bundled model's card (never in its training data).
HELD_OUT = ("bisect.py", "colorsys.py", "fnmatch.py", "glob.py", "heapq.py", "shlex.py",
            "textwrap.py", "string.py", "graphlib.py", "fractions.py")  # fmt: skip


# ------------------------------------------------------------------------ workload


def _functions(source: str, min_lines: int = 6, max_lines: int = 40) -> list[str]:
    """Top-level `def` blocks of a module, of a size that fits the prompt."""
    lines = source.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("def ")]
    blocks = []
    for a, b in zip(starts, [*starts[1:], len(lines)]):
        block = lines[a:b]
        while block and not block[-1].strip():
            block.pop()
        if min_lines <= len(block) <= max_lines:
            blocks.append("\n".join(block))
    return blocks


def held_out_functions(seed: int) -> list[str]:
    """The held-out stdlib modules' functions, shuffled by `seed` (deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    blocks: list[str] = []
    for name in HELD_OUT:
        path = stdlib / name
        if path.is_file():
            blocks += _functions(path.read_text(encoding="utf-8", errors="replace"))
    if not blocks:
        raise RuntimeError(f"no held-out modules found under {stdlib}")
    random.Random(seed).shuffle(blocks)
    return blocks


def edit_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` edit-style prompts from held-out stdlib modules (deterministic)."""
    blocks = held_out_functions(seed)
    prompts = []
    for block in blocks[:count]:
        first = block.splitlines()[0]
        prompts.append(
            f"# Original version:\n{block}\n\n\n# The same function, unchanged except for a "
            f"comment at the top:\n{first}\n    # Reviewed.\n"
        )
    return prompts


def continue_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` continuation prompts from held-out stdlib modules: the first half of a
    function, to be continued (nothing to copy from the prompt: what a model-based proposer
    such as the MTP head is for)."""
    blocks = held_out_functions(seed)
    prompts = []
    for block in blocks[:count]:
        lines = block.splitlines()
        prompts.append("\n".join(lines[: max(2, len(lines) // 2)]) + "\n")
    return prompts


def run_mode(
    model: str | None,
    prompts: Sequence[str],
    max_tokens: int,
    spec: dict[str, Any] | None,
    concurrency: int,
    **engine_kw: Any,
) -> dict[str, Any]:
    """Every prompt through one engine, `concurrency` requests at a time, in order."""
    config = EngineConfig(model=model, speculative_config=spec, **engine_kw)
    engine = Engine(config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engine.add_request("warmup", prompts[0][:200], params.replace(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    steps0, stats0 = engine.num_steps, engine.spec_stats
    drafts0, draft_tok0, acc0 = (
        stats0.num_drafts,
        stats0.num_draft_tokens,
        stats0.num_accepted_tokens,
    )
    per_pos0 = list(stats0.accepted_per_pos)
    outputs: dict[str, list[int]] = {}
    queue = list(enumerate(prompts))
    start = time.perf_counter()
    live: set[str] = set()
    while queue or live:
        while queue and len(live) < concurrency:
            i, text = queue.pop(0)
            rid = f"r{i}"
            engine.add_request(rid, text, params)
            live.add(rid)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                live.discard(out.request_id)
    seconds = time.perf_counter() - start
    stats = engine.spec_stats
    tokens = sum(len(t) for t in outputs.values())
    steps = engine.num_steps - steps0
    drafted = stats.num_draft_tokens - draft_tok0
    accepted = stats.num_accepted_tokens - acc0
    rows = stats.num_drafts - drafts0
    gate = engine.speculation.gate.counters if engine.speculation.gate else {}
    per_pos = [
        a - (per_pos0[i] if i < len(per_pos0) else 0) for i, a in enumerate(stats.accepted_per_pos)
    ]
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "steps": steps,
        "tokens_per_step": tokens / max(steps, 1),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / rows if rows else 1.0,
        # Accepted drafts at draft position j (1-based j = index + 1), per verified row.
        "accepted_per_position": per_pos,
        "acceptance_per_position": [a / rows for a in per_pos] if rows else [],
        "verify_steps": stats.verify_steps,
        "gate": dict(gate),
        "outputs": [outputs[f"r{i}"] for i in range(len(prompts))],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    make = edit_prompts if args.workload == "edit" else continue_prompts
    base = make(args.prompts, seed=args.seed)
    prompts = [p for p in base for _ in range(2)] if args.repeat else base
    engine_kw = dict(
        device=args.device, max_num_seqs=max(args.concurrency, 1), enable_prefix_caching=True
    )
    modes: dict[str, dict[str, Any] | None] = {"off": None}
    for method in args.methods.split(","):
        modes[method] = {"method": method, "num_speculative_tokens": args.k, "gate": args.gate}
        if method == "draft_model":
            if not args.draft_model:
                raise SystemExit("--methods draft_model needs --draft-model DIR")
            modes[method]["model"] = args.draft_model
    results = {}
    for name, spec in modes.items():
        results[name] = run_mode(
            args.model, prompts, args.max_tokens, spec, args.concurrency, **engine_kw
        )
        r = results[name]
        print(
            f"{name:>7}: {r['seconds']:.2f}s  {r['tokens_per_second']:.1f} tok/s  "
            f"{r['tokens_per_step']:.2f} tok/step  acceptance {r['acceptance_rate']:.2f}",
            file=sys.stderr,
        )
    off = results["off"]
    figures: dict[str, Any] = {}
    for name, r in results.items():
        figures[name] = {k: v for k, v in r.items() if k != "outputs"}
        figures[name]["speedup_vs_off"] = off["seconds"] / r["seconds"]
        figures[name]["identical_to_off"] = r["outputs"] == off["outputs"]
    path = write_record(
        "spec",
        model_shape="metrale-tiny-code" if args.model is None else Path(args.model).name,
        config={
            "prompts": len(prompts),
            "distinct_prompts": len(base),
            "max_tokens": args.max_tokens,
            "k": args.k,
            "gate": args.gate,
            "draft_model": args.draft_model,
            "concurrency": args.concurrency,
            "threads": torch.get_num_threads(),
            "held_out_modules": list(HELD_OUT),
            "workload": (
                "edit: a held-out function, then 'the same function, unchanged except for a "
                "comment'"
                if args.workload == "edit"
                else "continue: the first half of a held-out function, continued"
            )
            + ("; each prompt sent twice" if args.repeat else ""),
        },
        figures=figures,
        device=args.device,
        out_dir=args.out_dir,
        notes="peer: the same engine with speculation off, same run, same requests",
    )
    for name, f in figures.items():
        print(
            f"{name:>7}: speedup {f['speedup_vs_off']:.2f}x, {f['tokens_per_step']:.2f} tok/step, "
            f"acceptance {f['acceptance_rate']:.2f}, identical outputs {f['identical_to_off']}"
        )
    print(f"record: {path}")
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    parser.add_argument("--methods", default="ngram,suffix",
                        help="comma-separated: ngram, suffix, mtp, draft_model (with --draft-model)")  # fmt: skip
    parser.add_argument("--draft-model", default=None,
                        help="draft checkpoint of method draft_model (the target's vocabulary)")  # fmt: skip
    parser.add_argument("--workload", default="edit", choices=["edit", "continue"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--gate", default="auto", choices=["auto", "off"])
    parser.add_argument("--prompts", type=int, default=12, help="distinct prompts")
    parser.add_argument("--no-repeat", dest="repeat", action="store_false",
                        help="send each prompt once (default: twice)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench/records")
