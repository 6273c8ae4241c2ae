"""`metrale bench spec-cost`: what a speculative verify step costs, and what it buys.

Owner: bench.

`spec-cost` (any device, dummy weights of a config shape): the cost of a verify step with
k = 1..8 drafts per row relative to a plain decode step, at several batch sizes, each with
the same context; then, at batch 1, the projected speedup at acceptance `a` (E[tokens] /
cost ratio, E[tokens] = 1 + a + ... + a^k) and the measured one: the engine decodes with k
drafts a step, each accepted with probability a (`forced_acceptance`: dummy weights leave
nothing a proposer could predict), against the same engine without speculation.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from metrale.bench.flags import add_flags, add_model_flags
from metrale.bench.record import write_record
from metrale.cache.block_pool import blocks_for
from metrale.config import EngineConfig
from metrale.engine.engine import BUNDLED_MODEL_DIR, Engine
from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import SamplingRow
from metrale.spec.proposer import DraftRequest, Proposer

# ------------------------------------------------------------------------ verify cost


class RepeatLast(Proposer):
    """Drafts the last token k times: with acceptance forced (`forced_acceptance`), what
    the drafts are does not matter, only how many."""

    name = "repeat-last"

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[int(r.tokens[-1])] * r.max_drafts for r in requests]


@contextlib.contextmanager
def forced_acceptance(rate: float, seed: int = 1234) -> Iterator[None]:
    """Greedy verify accepts each draft with probability `rate`, independently (a Bernoulli
    draw in place of "the draft is the argmax"); every other part of the step is the real
    one. Dummy weights make near-flat logits whose argmax a proposer cannot know, and where a
    verify step's rounding (k + 1 rows) and a decode step's (one row) pick different
    near-ties, so a proposer replaying plain decoding's tokens is accepted ~5% of the time
    on the H200 in bf16: forcing is the only way to set the rate there."""
    import metrale.sampling.verify as verify

    gen = torch.Generator().manual_seed(seed)

    def accepts(token_ids: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
        draw = torch.rand(draft_ids.shape, generator=gen) < rate
        return draw.to(draft_ids.device, non_blocking=True)

    original = verify.greedy_accepts
    verify.greedy_accepts = accepts  # type: ignore[assignment]
    try:
        yield
    finally:
        verify.greedy_accepts = original  # type: ignore[assignment]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefilled_seqs(engine: Engine, batch: int, context: int, high: int) -> list[Any]:
    """`batch` new sequences of the engine's model, each prefilled with `context` random ids
    in `[8, high)` (seeded by `batch`)."""
    model = engine.model
    gen = torch.Generator().manual_seed(batch)
    seqs = []
    for _ in range(batch):
        seq = model.alloc_sequence()
        prompt = torch.randint(8, high, (context,), generator=gen).tolist()
        model.prefill_chunk(prompt, seq, 0, context, True)
        seqs.append(seq)
    return seqs


def verify_cost(engine: Engine, batch: int, ks: Sequence[int], context: int, iters: int) -> dict:
    """Seconds of a plain decode step and of a verify step with each k, at `batch` rows of
    `context` tokens; every verify is rolled back, so each call sees the same state."""
    model = engine.model
    device = torch.device(str(getattr(model, "device", "cpu")))
    seqs = prefilled_seqs(engine, batch, context, engine.vocab_size)
    tokens = [1] * batch

    # `commit_accepted_prefix(seq, 0, n)` rewinds the last n tokens: the whole step here.
    # With `sample`, the step includes the engine's sampler and the read back of its tokens.
    rows = [SamplingRow(SamplingParams(temperature=0)) for _ in range(batch)]

    def decode(sample: bool = False) -> None:
        logits = model.decode_batch(tokens, seqs)
        if sample:
            engine.sampler.sample(logits, rows).to_host()
        for s in seqs:
            model.commit_accepted_prefix(s, 0, 1)

    def verify(k: int, sample: bool = False) -> None:
        drafts = [[2] * k for _ in range(batch)]
        result = model.mixed_verify_batch(tokens, drafts, seqs, [])
        if sample:
            engine.sampler.verify(result.decode_logits, rows, drafts).to_host()
        for s in seqs:
            model.commit_accepted_prefix(s, 0, k + 1)

    def timed(fn: Any) -> float:
        for _ in range(3):
            fn()
        _sync(device)
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            _sync(device)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    plain = timed(decode)
    plain_step = timed(lambda: decode(True))
    out: dict[str, Any] = {
        "decode_ms": plain * 1000,
        "verify_ms": {},
        "ratio": {},
        "decode_step_ms": plain_step * 1000,
        "verify_step_ms": {},
        "step_ratio": {},
    }
    for k in ks:
        t = timed(lambda k=k: verify(k))
        out["verify_ms"][k] = t * 1000
        out["ratio"][k] = t / plain
        t = timed(lambda k=k: verify(k, True))
        out["verify_step_ms"][k] = t * 1000
        out["step_ratio"][k] = t / plain_step
    for s in seqs:
        model.free_sequence(s)
    return out


def run_cost(args: argparse.Namespace) -> dict[str, Any]:
    from metrale.bench.synthetic import prepare_model_dir

    model_dir = prepare_model_dir(args.config_dir) if args.config_dir else BUNDLED_MODEL_DIR
    if args.mtp and args.config_dir:
        model_dir = with_mtp_layer(Path(model_dir))
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(
        model=str(model_dir), device=args.device, dtype=args.dtype,
        load_format="dummy" if args.config_dir else "auto",
        max_model_len=args.context + args.max_tokens + 64, max_num_seqs=max(batches),
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    method = "mtp" if args.mtp else "ngram"
    spec = {"method": method, "num_speculative_tokens": max(ks), "gate": "off"}
    # Graphs are captured here, for every k measured (the factory would capture one k).
    engine = Engine(EngineConfig(**common, speculative_config=spec, enforce_eager=True))
    graphs = capture_verify_graphs(engine, [k + 1 for k in ks], max(batches))
    curve = {}
    for b in batches:
        curve[b] = verify_cost(engine, b, ks, args.context, args.iters)
        print(f"batch {b}: forward: decode {curve[b]['decode_ms']:.3f} ms, verify/decode "
              + " ".join(f"k{k}={r:.2f}" for k, r in curve[b]["ratio"].items())
              + f"; whole step (forward, sampler, read back): decode "
              f"{curve[b]['decode_step_ms']:.3f} ms, verify/decode "
              + " ".join(f"k{k}={r:.2f}" for k, r in curve[b]["step_ratio"].items()),
              file=sys.stderr)  # fmt: skip
    a = args.acceptance
    first = curve[batches[0]]
    expected = {k: sum(a**i for i in range(k + 1)) for k in ks}
    # E[tokens per verify] over the step's cost: the whole step's (the forward alone beside).
    projected = {k: expected[k] / first["step_ratio"][k] for k in ks}
    projected_forward = {k: expected[k] / first["ratio"][k] for k in ks}
    best_k = max(projected, key=lambda k: projected[k])
    measured = {k: measure_speedup(engine, args, k, a) for k in sorted({4, best_k} & set(ks))}
    for b in args.measure_batches:  # more rows at a time (the same k's)
        measured.update(
            {f"{k}@batch{b}": measure_speedup(engine, args, k, a, b) for k in sorted(measured)
             if isinstance(k, int)}
        )  # fmt: skip
    figures = {
        "graphs": graphs,
        "cost_curve": curve,
        f"projected_speedup_batch_{batches[0]}": projected,
        f"projected_speedup_batch_{batches[0]}_forward_only": projected_forward,
        "measured": measured,
        "acceptance": a,
    }
    path = write_record(
        "spec-cost",
        model_shape=args.shape
        or (Path(args.config_dir).name if args.config_dir else "metrale-tiny-code"),
        config={
            "ks": ks,
            "batches": batches,
            "context": args.context,
            "iters": args.iters,
            "device": args.device,
            "dtype": args.dtype,
            "acceptance": a,
            "graphs": graphs,
            "proposer": "the MTP head (one random-weight layer)"
            if args.mtp
            else "repeat-last (drafts are free)",
        },
        figures=figures,
        device=args.device,
        out_dir=args.out_dir,
        notes="peer: the same engine's plain decode step (ratio) and plain decoding (speedup)",
    )
    print(f"projected speedup at batch {batches[0]}, acceptance {a}: "
          + " ".join(f"k{k}={p:.2f}" for k, p in projected.items()))  # fmt: skip
    for k, m in measured.items():
        print(f"measured at k={k}: {m['speedup']:.2f}x (first-draft acceptance "
              f"{m['first_draft_acceptance']:.2f}, tokens per verify "
              f"{m['mean_acceptance_length']:.2f})")  # fmt: skip
    print(f"record: {path}")
    return figures


def capture_verify_graphs(engine: Engine, query_lens: Sequence[int], max_batch: int) -> str:
    """Give the engine's model decode graphs for Q = 1 and every verify width measured (on
    CUDA; elsewhere every forward stays eager). Returns what was captured, for the record."""
    from metrale.model_engine.cuda_graphs import DecodeGraphRunner

    model = engine.model
    device = torch.device(str(getattr(model, "device", "cpu")))
    if device.type != "cuda":
        return "none (eager)"
    runner = DecodeGraphRunner(
        model.module, model.main_kv_layers, device, max_batch,
        blocks_for(model.max_model_len, model.block_size), model.block_size,
        (1, *query_lens), verify_max_batch=max_batch, head_hidden=model.mtp_enabled,
    )  # fmt: skip
    runner.capture()
    model.graph_runner = runner
    text = f"Q={runner.query_lens}, rungs {runner.rungs} ({runner.capture_bytes / 2**20:.0f} MiB)"
    if model.mtp_enabled:  # the head's propose graphs, one per k measured
        from metrale.model_engine.mtp_graphs import MtpGraphRunner

        for q in query_lens:
            head = MtpGraphRunner(
                model.module, model.head_kv_layers, device, model.dtype, max_batch,
                blocks_for(model.max_model_len, model.block_size), model.block_size, q - 1,
            )  # fmt: skip
            head.capture()
            model.mtp_graphs[head.k] = head
        text += f"; MTP propose graphs for k={sorted(model.mtp_graphs)}"
    return text


def with_mtp_layer(model_dir: Path) -> Path:
    """A copy of a config-shape directory whose config asks for one MTP layer (dummy weights
    fill it like the rest): the cost of an MTP draft step on that shape."""
    import json
    import shutil
    import tempfile

    dst = Path(tempfile.mkdtemp(prefix=f"metrale-bench-mtp-{model_dir.name}-"))
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copyfile(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def measure_speedup(
    engine: Engine, args: argparse.Namespace, k: int, acceptance: float, batch: int = 1
) -> dict:
    """Greedy decoding with k drafts per step, acceptance forced to `acceptance` per draft
    (`forced_acceptance`), against plain decoding of the same prompts and lengths; `batch`
    requests run at a time (1: one after the other)."""
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(8, vocab, (args.context,), generator=gen).tolist()
        for _ in range(max(args.requests, batch))
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def decode_all(eng: Engine) -> tuple[float, int]:
        tokens = 0
        start = time.perf_counter()
        for first in range(0, len(prompts), batch):
            for i, p in enumerate(prompts[first : first + batch]):
                rid = f"m{first + i}-{time.monotonic_ns()}"
                eng.add_request(rid, None, params, prompt_token_ids=p)
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        tokens += len(o.outputs[0].token_ids)
        return time.perf_counter() - start, tokens

    plain_engine = Engine(
        engine.config.replace(speculative_config=None), model=engine.model,
        tokenizer=engine.tokenizer,
    )  # fmt: skip
    # Plain decoding keeps no hidden rows for a head, as on a model without one.
    model, head_on = engine.model, engine.model.has_proposer()
    model.mtp_enabled = False  # type: ignore[attr-defined]
    try:
        decode_all(plain_engine)  # warm-up
        plain_s, plain_tokens = decode_all(plain_engine)
    finally:
        model.mtp_enabled = head_on  # type: ignore[attr-defined]
    mtp = head_on
    spec_cfg = {"method": "mtp" if mtp else "ngram", "num_speculative_tokens": k, "gate": "off"}
    spec_engine = Engine(
        engine.config.replace(speculative_config=spec_cfg), model=engine.model,
        tokenizer=engine.tokenizer, proposer=None if mtp else RepeatLast(),
    )  # fmt: skip
    with forced_acceptance(acceptance):
        decode_all(spec_engine)  # warm-up
        spec_engine.speculation.stats = type(spec_engine.spec_stats)()
        counters0 = engine.model.forward_counters()
        spec_s, spec_tokens = decode_all(spec_engine)
    counters = {k: v - counters0.get(k, 0) for k, v in engine.model.forward_counters().items()}
    st = spec_engine.spec_stats
    return {
        "plain_seconds": plain_s,
        "spec_seconds": spec_s,
        "tokens": [plain_tokens, spec_tokens],
        "speedup": plain_s / spec_s,
        # Accepted / drafted over every draft slot; the forced per-position (conditional)
        # acceptance is the first slot's rate.
        "acceptance_rate": st.acceptance_rate,
        "first_draft_acceptance": st.accepted_per_pos[0] / st.num_drafts if st.num_drafts else 0.0,
        "mean_acceptance_length": st.mean_acceptance_length,
        "acceptance": "forced: a Bernoulli draw per draft in place of the argmax test",
        "batch": batch,
        "proposer": "mtp" if mtp else "repeat-last",
        # Graph replays and eager forwards (and MTP proposes) of the speculating run.
        "forward_counters": counters,
    }


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, config_help="a config shape (dummy weights)")
    add_flags(parser, {
        "--ks": "1,2,3,4,5,6,7,8", "--batches": "1,8,32,128", "--context": 512, "--iters": 20,
        "--acceptance": 0.6, "--requests": 4,
    })  # fmt: skip
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="draft with a (random) MTP head added to the config shape",
    )
    parser.add_argument("--measure-batches", type=lambda s: [int(b) for b in s.split(",") if b],
                        default=[], help="also measure the speedup with these many rows")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="leaves room for the verify graphs of every k")  # fmt: skip
    parser.add_argument("--out-dir", default="bench/records")
