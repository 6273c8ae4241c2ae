"""Where the engine's decode step makes the host wait for the device: runs `engine.step()`
over C requests (optionally under a JSON-schema grammar) with
`torch.cuda.set_sync_debug_mode("warn")`, and prints each distinct stack (metrale frames
only) that synchronised, with how many times it did.

Usage (GPU): PYTHONPATH=. python3 tools/sync_audit.py bench/configs/qwen3-0.6b --concurrency 64 \
    [--grammar] [--steps 30]
The read-back of the sampled tokens (`SampledBatch.to_host`) is the step's one intended wait.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

from metrale import Engine, EngineConfig, SamplingParams
from metrale.bench.structured import TOOL_CALL_SCHEMA, stdlib_tokenizer
from metrale.bench.synthetic import prepare_model_dir
from metrale.sampling.structured import GrammarSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config_dir")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--grammar", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    model_dir = prepare_model_dir(args.config_dir)
    vocab = int(__import__("json").loads((model_dir / "config.json").read_text())["vocab_size"])
    engine = Engine(EngineConfig(
        model=str(model_dir), tokenizer=str(stdlib_tokenizer(vocab)), load_format="dummy",
        max_num_seqs=args.concurrency, max_model_len=1024, enable_prefix_caching=False,
    ))  # fmt: skip
    spec = GrammarSpec.json_schema(TOOL_CALL_SCHEMA, "audit") if args.grammar else None
    params = SamplingParams(temperature=args.temperature, max_tokens=400, ignore_eos=True,
                            structured_outputs=spec, seed=1)  # fmt: skip
    for i in range(args.concurrency):
        engine.add_request(f"r{i}", list(range(10 + i, 74 + i)), params)
    for _ in range(8):  # admission, prefill, the first fed steps
        engine.step()
    stacks: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        frames = [f for f in traceback.extract_stack() if "/metrale/" in f.filename]
        stacks["\n".join(f"  {f.filename.split('/metrale/')[-1]}:{f.lineno} {f.name}"
                         for f in frames[-6:])] += 1  # fmt: skip

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    fed = engine.fed_steps
    for _ in range(args.steps):
        engine.step()
    torch.cuda.set_sync_debug_mode("default")
    print(
        f"{args.steps} steps, {engine.fed_steps - fed} fed, late-sampled {engine.late_sampled_steps}"
    )
    for stack, count in stacks.most_common():
        print(f"{count} syncs at:\n{stack}")


if __name__ == "__main__":
    main()
