"""`metrale bench structured`: what grammar-constrained decoding costs per step.

Owner: bench.

The engine's decode step at batch C (`engine.step()` over C requests: the pipeline a server
runs) and the same step run synchronously (forward, sampler, read back, matcher advance, no
overlap), with every row constrained by the JSON schema of a realistic tool call (three tools, nested
objects, enums, arrays, bounded strings and numbers), against the same step unconstrained;
each at greedy and at temperature 0.7. Dummy weights of a config shape (e.g.
`bench/configs/qwen3-8b`), so what the grammar allows, not what the model would pick, drives
the matchers: a row whose grammar ends starts again on a fresh matcher (a new request with
the same schema), so every step keeps C constrained rows. Also timed alone: the host's
bitmask fill for the C rows (`grammar_rows.fill_rows`), which on CUDA overlaps the forward.

The tokenizer decides the grammar's cost: `--tokenizer DIR` (a real checkpoint's
`tokenizer.json`, e.g. Qwen3's 151k byte-level BPE) is the realistic figure; without it a
byte-level BPE is trained on the Python standard library up to the model's vocabulary (the
size it reaches is recorded), since the synthetic word-level tokenizer of `--config-dir`
runs has no JSON punctuation at all. Target (issue 17): overhead <= 5% at C=1 and C=64.

Needs xgrammar on the machine (`pip install xgrammar`, or its wheel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from metrale.bench.flags import add_flags, add_model_flags
from metrale.bench.record import write_record
from metrale.bench.spec_cost import prefilled_seqs
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.sampling.grammar import bitmask_words
from metrale.sampling.grammar_rows import fill_rows
from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import SamplingRow
from metrale.sampling.structured import GrammarSpec


def _closed_object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """A JSON schema object of exactly these properties (no others)."""
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _tool_call(name: str, arguments: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """`{"name": name, "arguments": {...}}` with these argument properties."""
    return _closed_object(
        {"name": {"const": name}, "arguments": _closed_object(arguments, required)},
        ["name", "arguments"],
    )


#: The tool-call schema: `{"name": ..., "arguments": {...}}` for one of three tools.
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "anyOf": [
        _tool_call(
            "get_weather",
            {
                "location": {"type": "string", "maxLength": 64},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "include_hourly": {"type": "boolean"},
            },
            ["location", "unit", "days"],
        ),
        _tool_call(
            "search_flights",
            {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "format": "date"},
                "passengers": {
                    "type": "array",
                    "items": _closed_object(
                        {
                            "type": {"enum": ["adult", "child", "infant"]},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        },
                        ["type"],
                    ),
                    "minItems": 1,
                    "maxItems": 9,
                },
                "cabin": {"enum": ["economy", "premium", "business", "first"]},
                "max_price": {"type": "number", "minimum": 0},
            },
            ["origin", "destination", "date", "passengers"],
        ),
        _tool_call(
            "create_event",
            {
                "title": {"type": "string", "maxLength": 120},
                "start": {"type": "string", "format": "date-time"},
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 1440},
                "attendees": {
                    "type": "array",
                    "items": {"type": "string", "format": "email"},
                    "maxItems": 20,
                },
                "reminder": _closed_object(
                    {
                        "minutes_before": {"type": "integer", "minimum": 0},
                        "method": {"enum": ["email", "popup"]},
                    },
                    ["minutes_before", "method"],
                ),
            },
            ["title", "start"],
        ),
    ]
}


def stdlib_tokenizer(vocab_size: int) -> Path:
    """A byte-level BPE trained on the Python standard library (every `*.py` under it), up
    to `vocab_size` tokens, written as a tokenizer directory; its EOS is `<|endoftext|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.rglob("*.py") if p.is_file())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Any:
        for name in files:
            try:
                yield Path(name).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few test files are not UTF-8

    tok.train_from_iterator(texts(), trainer)
    out = Path(tempfile.mkdtemp(prefix="metrale-bench-tokenizer-"))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return out


def step_cost(
    engine: Engine, batch: int, constrained: bool, temperature: float, context: int, steps: int
) -> dict[str, float]:
    """Median and mean seconds of a decode step at `batch` rows (forward, sampler, read
    back and, when `constrained`, the matchers' advance), and of the bitmask fill alone."""
    model = engine.model
    device = torch.device(str(getattr(model, "device", "cpu")))
    vocab = engine.vocab_size
    seqs = prefilled_seqs(engine, batch, context, min(vocab, 1000))
    spec = GrammarSpec.json_schema(TOOL_CALL_SCHEMA, "bench")
    backend = engine.grammar_backend
    params = SamplingParams(temperature=temperature, max_tokens=10**6, seed=7)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    states = [backend.state(spec) for _ in range(batch)] if constrained else None
    restarts = 0
    tokens = [1] * batch
    times: list[float] = []
    fills: list[float] = []
    host = torch.empty((batch, bitmask_words(vocab)), dtype=torch.int32)
    for step in range(steps + 3):
        start = time.perf_counter()
        logits = model.decode_batch(tokens, seqs)
        rows = [
            SamplingRow(
                params=params,
                output_token_ids=outputs[i],
                seed=7 + i,
                eos_token_ids=engine.eos_token_ids,
                grammar=states[i] if states is not None else None,
            )
            for i in range(batch)
        ]
        out = engine.sampler.sample(logits, rows).to_host()
        tokens = out.token_ids
        for i, token in enumerate(tokens):
            outputs[i].append(token)
        if states is not None:
            for i, state in enumerate(states):
                state.sync(outputs[i])
                if not state.live:  # the call is complete: the next request starts
                    states[i] = backend.state(spec)
                    outputs[i] = []
                    restarts += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= 3:
            times.append(time.perf_counter() - start)
            if states is not None:
                begin = time.perf_counter()
                fill_rows(host, states)
                fills.append(time.perf_counter() - begin)
    for seq in seqs:
        model.free_sequence(seq)
    result = {
        "step_ms_median": statistics.median(times) * 1000,
        "step_ms_mean": statistics.fmean(times) * 1000,
    }
    if fills and states is not None:
        result["fill_ms_median"] = statistics.median(fills) * 1000
        result["calls_completed"] = restarts
        #: Rows whose grammar refused a sampled token (must stay 0: the mask works).
        result["failed_rows"] = sum(state.failed for state in states)
        result["tokens_in_open_calls"] = sum(len(o) for o in outputs)
    return result


def _profiler(enabled: bool) -> Any:
    """A `cProfile.Profile` when `enabled` (`--profile`), else None."""
    if not enabled:
        return None
    import cProfile

    return cProfile.Profile()


def _print_profile(profiler: Any, title: str) -> None:
    """The host functions that took the most time under `profiler`, to stderr."""
    if profiler is None:
        return
    import pstats

    print(f"--- cProfile: {title} (by own time) ---", file=sys.stderr)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)


def engine_step_cost(
    engine: Engine,
    batch: int,
    constrained: bool,
    temperature: float,
    context: int,
    steps: int,
    profiler: Any = None,
    stream_outputs: bool = True,
) -> dict[str, float]:
    """Median seconds between `engine.step()` returns over the steady decode steps of `batch`
    requests served by the engine itself, called as the server's loops call it (`on_outputs`:
    the outputs ready while the device computes are handed over before the wait;
    `stream_outputs=False`: a plain `engine.step()`, every output returned at its end, as
    the records before 2026-12-02's fifth session measured it). The engine's pipeline: a
    decode step fed on the device is launched before the step before it is read back; under
    a grammar its sampler waits for that read-back and the mask, which the host fills while
    the forward runs. A request whose tool call completes is replaced by a fresh one; steps
    that planned a prefill (or otherwise drained the pipeline) are left out of the figure on
    both sides, and so is the fed step after one (it reads that prefill step back, so its
    interval holds the prefill's device time: a cost of the replaced requests, which the
    unconstrained side, whose requests never end, does not have). `profiler` (a
    `cProfile.Profile`) runs over the timed steps (`--profile`; it slows them, so the
    figures of a profiled run are not the record's)."""
    gen = torch.Generator().manual_seed(1000 + batch)
    vocab = engine.vocab_size
    spec = GrammarSpec.json_schema(TOOL_CALL_SCHEMA, "bench") if constrained else None
    params = SamplingParams(
        temperature=temperature, max_tokens=steps + 16, seed=7, ignore_eos=True,
        structured_outputs=spec,
    )  # fmt: skip
    counter = iter(range(10**9))

    def submit() -> None:
        prompt = torch.randint(8, min(vocab, 1000), (context,), generator=gen).tolist()
        engine.add_request(f"s{batch}-{constrained}-{next(counter)}", prompt, params)

    for _ in range(batch):
        submit()
    times: list[float] = []
    all_fed: list[float] = []
    restarts = 0
    last = time.perf_counter()
    taken = 0
    previous_fed = False
    while taken < steps + 8 and engine.has_unfinished():
        fed_before = engine.fed_steps
        outs: list[Any] = []
        # As the server's engine loops call it: the outputs built while the device
        # computes are handed over at once, the rest returned after the wait.
        outs += engine.step(on_outputs=outs.extend if stream_outputs else None)
        now = time.perf_counter()
        fed = engine.fed_steps > fed_before
        if fed:
            taken += 1
            if taken > 8:  # warm-up
                all_fed.append(now - last)
                if previous_fed:  # it read back a decode step, not a prefill's
                    times.append(now - last)
            if profiler is not None and taken == 8:
                profiler.enable()
        previous_fed = fed
        last = now
        for out in outs:
            if out.finished:
                restarts += 1
                submit()
    if profiler is not None:
        profiler.disable()
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return {
        "step_ms_median": statistics.median(times) * 1000,
        "step_ms_mean": statistics.fmean(times) * 1000,
        "fed_steps_timed": len(times),
        "requests_completed": restarts,
        #: Every fed step, also those that read back a prefill step (a replaced request's
        #: prompt): the figure of records before 2026-12-02.
        "all_fed_step_ms_median": statistics.median(all_fed) * 1000,
        "fed_steps_after_a_prefill": len(all_fed) - len(times),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from metrale.bench.synthetic import prepare_model_dir

    model_dir = prepare_model_dir(args.config_dir)
    vocab = int(json.loads((Path(args.config_dir) / "config.json").read_text())["vocab_size"])
    tokenizer = Path(args.tokenizer) if args.tokenizer else stdlib_tokenizer(vocab)
    batches = [int(b) for b in args.batches.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    engine = Engine(
        EngineConfig(
            model=str(model_dir), tokenizer=str(tokenizer), device=args.device,
            dtype=args.dtype, load_format="dummy", max_num_seqs=max(batches),
            max_model_len=args.context + args.steps + 64,
            gpu_memory_utilization=args.gpu_memory_utilization,
            # Random prompts share nothing; without the cache every block is free again
            # between the model-level and the engine runs.
            enable_prefix_caching=False,
        )
    )  # fmt: skip
    tokenizer_size = engine.tokenizer.vocab_size
    compile_start = time.perf_counter()
    engine.grammar_backend.compile(GrammarSpec.json_schema(TOOL_CALL_SCHEMA, "bench"))
    compile_ms = (time.perf_counter() - compile_start) * 1000
    figures: dict[str, Any] = {"compile_ms": compile_ms, "tokenizer_vocab": tokenizer_size}
    for temperature in temperatures:
        for batch in batches:
            sync_plain = step_cost(engine, batch, False, temperature, args.context, args.steps)
            sync_grammar = step_cost(engine, batch, True, temperature, args.context, args.steps)
            profiler = _profiler(args.profile)
            plain = engine_step_cost(
                engine, batch, False, temperature, args.context, args.steps, profiler
            )
            _print_profile(profiler, f"unconstrained engine steps, C={batch} t={temperature:g}")
            profiler = _profiler(args.profile)
            grammar = engine_step_cost(
                engine, batch, True, temperature, args.context, args.steps, profiler
            )
            _print_profile(profiler, f"constrained engine steps, C={batch} t={temperature:g}")
            overhead = grammar["step_ms_median"] / plain["step_ms_median"] - 1
            sync_overhead = sync_grammar["step_ms_median"] / sync_plain["step_ms_median"] - 1
            key = f"C{batch}_t{temperature:g}"
            figures[key] = {
                "unconstrained": plain,
                "constrained": grammar,
                "overhead_pct": overhead * 100,
                "synchronous_step": {
                    "unconstrained": sync_plain,
                    "constrained": sync_grammar,
                    "overhead_pct": sync_overhead * 100,
                },
            }
            print(
                f"C={batch} temperature {temperature:g}: engine step "
                f"{plain['step_ms_median']:.3f} ms unconstrained, "
                f"{grammar['step_ms_median']:.3f} ms constrained ({overhead * 100:+.1f}%); "
                f"synchronous step {sync_overhead * 100:+.1f}%, host fill "
                f"{sync_grammar['fill_ms_median']:.3f} ms",
                file=sys.stderr,
            )
    if args.profile:
        print("profiled run (slower steps): no record written", file=sys.stderr)
        return figures
    path = write_record(
        "structured",
        model_shape=args.shape or Path(args.config_dir).name,
        config={
            "batches": batches,
            "temperatures": temperatures,
            "context": args.context,
            "steps": args.steps,
            "device": args.device,
            "dtype": args.dtype,
            "tokenizer": str(args.tokenizer or "byte-level BPE trained on the stdlib"),
            "schema": "TOOL_CALL_SCHEMA (three tools) in metrale/bench/structured.py",
        },
        figures=figures,
        device=args.device,
        out_dir=args.out_dir,
        notes="peer: the same engine's unconstrained decode step; target overhead <= 5%. "
        "overhead_pct: the engine's steady decode step (engine.step with on_outputs as the "
        "server's loops call it, since 2026-12-02 (fifth session); pipelined; a fed step "
        "that reads back a prefill step is left out: all_fed_step_ms_median keeps it); "
        "synchronous_step: forward, sample, read back and matcher advance in sequence "
        "(no overlap), the figure of earlier records",
    )
    print(f"record: {path}")
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory (default: a BPE trained on the stdlib)")  # fmt: skip
    add_model_flags(parser, config_dir="bench/configs/qwen3-8b",
                    config_help="a config shape (dummy weights; default: qwen3-8b)")  # fmt: skip
    add_flags(parser, {
        "--batches": "1,64", "--temperatures": "0,0.7", "--context": 512, "--steps": 200,
        "--gpu-memory-utilization": 0.85, "--out-dir": "bench/records",
    })  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the engine steps (no record: they run slower); "
                             "print the top functions")  # fmt: skip
