"""Host time of one beam-search step (issue 18): the tiny NLLB shape (`metrale bench
translate --shape tiny-nllb`'s config) on the CPU, `--batch` requests x `--beams` beams run
together, the decoder step through `EncDecStepGraphs` (the H200 path: static buffers, one
flat host-to-device copy), but its body (the model forward) replaced by fixed logits, so
what is timed is the host side: the beam driver's bookkeeping, its small tensor ops (each a
kernel launch on a GPU) and the decoder step's metadata, block tables and staging.

    PYTHONPATH=. .venv/bin/python tools/profile_beam_host.py [--baseline /work/main]
        [--vocab 8192] [--profile]

`--baseline DIR` loads another checkout's `beam.py` driver, `decode_batch` and
`EncDecStepGraphs.run` (as separate modules, over this tree's model) and alternates its
batches with this tree's in the same process, so a shared machine's load drifts over both
alike; the record gives both figures, their ratio and whether both gave the same digest (the
same tokens and scores: on the CPU they must).

The stub logits are a fixed random `[rows, vocab]` block (row i of a step gets row i), so the
search diverges, forks and copies blocks as a real one does; a digest of every output token
and score is recorded, so two commits' records show the same search. Writes a record under
bench/records/ (instrument "profile-beam-host"): the median and mean ms per steady beam step,
as this thread's CPU time (`time.thread_time`: a shared, loaded machine's waits are not
counted; torch runs on this one thread)
(admission steps, which run the encoder, are excluded), with and without the KV block copies
(copy-on-write: a memcpy of every copied block on the CPU, a few kernels on a GPU), and the
medians of its parts: the decoder step's host side (`decode_batch`), the block copies, the
search's device half (`_search_group`, tiny tensor ops at the default vocabulary, i.e. mostly
their dispatch) and its host half (`_apply`: token history, forks, frees); with `--profile`,
the top functions of one cProfiled batch. `--device cuda` (the H200) runs the tiny model's
captured step graphs for real and times wall clock: the same driver and decoder host code plus
the waits on the device (the step's one read waits for the forward and the search).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import importlib.util
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH first: time another tree

from metrale.bench.record import write_record
from metrale.bench.translate import TINY_NLLB, build_random_nllb
from metrale.model_engine.beam import BeamParams, BeamRequest, BeamSearchDriver
from metrale.model_engine.encdec_graphs import EncDecStepGraphs
from metrale.model_engine.encdec_model import EncoderDecoderModel, load_encoder_decoder

PARTS = ("decode_host", "kv_copy", "search_group", "apply")


def _load(root: Path, name: str) -> types.ModuleType:
    path = root / "metrale" / "model_engine" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def _summary(step_ms: list[float], parts: dict[str, list[float]]) -> dict[str, float]:
    med = statistics.median
    return {
        "steps": len(step_ms),
        "step_ms_median": med(step_ms),
        "step_ms_mean": statistics.fmean(step_ms),
        # The host figure: the step without the CPU's memcpy of copied KV blocks.
        "step_ms_median_excl_kv_copy": med(s - c for s, c in zip(step_ms, parts["kv_copy"])),
        **{f"{k}_ms_median": med(v) for k, v in parts.items()},
        # The lower decile: the step's own cost with less of a shared machine's interference.
        "step_ms_p10": statistics.quantiles(step_ms, n=10)[0],
        **{f"{k}_ms_p10": statistics.quantiles(v, n=10)[0] for k, v in parts.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3, help="batches timed (after one warm-up)")
    p.add_argument("--no-repeat-ngram", type=int, default=0)
    p.add_argument(
        "--device", default="cpu",
        help="cpu (default: the forward stubbed, CPU time) or cuda (the tiny model's real "
        "graph replays, wall time: the host side plus what the host waits for)",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--baseline", default=None, help="another checkout to time alongside")
    p.add_argument("--profile", action="store_true", help="cProfile one batch, top functions")
    p.add_argument("--out-dir", default="bench/records")
    p.add_argument("--notes", default="")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    tmp = Path(tempfile.mkdtemp(prefix="metrale-beam-host-"))
    model_dir, _ = build_random_nllb(tmp / "m", {**TINY_NLLB, "vocab_size": args.vocab})
    rows = args.batch * args.beams
    blocks = 2 * rows * (-(-(args.max_tokens + 2) // 16)) + 64
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = load_encoder_decoder(
        model_dir, device=dev, dtype=dtype, num_blocks=blocks, block_size=16,
        max_model_len=args.max_tokens + 2,
    )  # fmt: skip
    graphs = model.enable_step_graphs(max_rows=rows, max_sources=args.batch, source_cap=32)
    clock = time.perf_counter
    if dev.type == "cpu":
        clock = time.thread_time
        gen = torch.Generator().manual_seed(0)
        fixed = torch.randn(graphs.max_rows, args.vocab, generator=gen) * 4.0
        graphs._body = lambda n: fixed[:n]  # type: ignore[method-assign]  # the forward, stubbed

    spent: dict[str, float] = {}

    def timed(obj: Any, name: str, key: str) -> None:
        real = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            start = clock()
            try:
                return real(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + clock() - start

        setattr(obj, name, wrapper)

    # Each variant: its driver class and the decoder step's host functions.
    variants: dict[str, tuple[Any, Any, Any]] = {
        "this": (BeamSearchDriver, EncoderDecoderModel.decode_batch, EncDecStepGraphs.run)
    }
    if args.baseline:
        root = Path(args.baseline)
        base_beam = _load(root, "beam")
        variants["baseline"] = (
            base_beam.BeamSearchDriver,
            _load(root, "encdec_model").EncoderDecoderModel.decode_batch,
            _load(root, "encdec_graphs").EncDecStepGraphs.run,
        )
    current: dict[str, Any] = {}
    model.decode_batch = lambda *a, **k: current["decode"](model, *a, **k)  # type: ignore[method-assign]
    graphs.run = lambda *a, **k: current["run"](graphs, *a, **k)  # type: ignore[method-assign]
    # The decoder step's host side; the KV block copies (copy-on-write: device work on a GPU,
    # a memcpy of every copied block here); the search's device half and its host half.
    timed(model, "decode_batch", "decode_host")
    timed(model.kv_cache, "copy_blocks", "kv_copy")
    src_id, tgt_id, eos = args.vocab - 2, args.vocab - 1, 2
    params = BeamParams(
        num_beams=args.beams, early_stopping=True, max_tokens=args.max_tokens,
        no_repeat_ngram_size=args.no_repeat_ngram,
    )  # fmt: skip

    def batch(tag: str, seed: int) -> list[BeamRequest]:
        rng = random.Random(seed)
        reqs = []
        for i in range(args.batch):
            body = [rng.randrange(4, args.vocab - 2) for _ in range(rng.randrange(8, 25))]
            src = [src_id, *body, eos]
            reqs.append(BeamRequest(f"{tag}-{i}", [eos], params, source=src, forced=[tgt_id]))
        return reqs

    drivers: dict[str, Any] = {}
    for name, (cls, _, _) in variants.items():
        driver = drivers[name] = cls(model, [eos])
        for method in ("_search_group", "_apply"):
            timed(driver, method, method.strip("_"))
    digests = {name: hashlib.sha256() for name in variants}
    steps: dict[str, list[float]] = {name: [] for name in variants}
    parts: dict[str, dict[str, list[float]]] = {name: {k: [] for k in PARTS} for name in variants}

    def run_batch(name: str, seed: int, record: bool) -> None:
        driver = drivers[name]
        current["decode"], current["run"] = variants[name][1], variants[name][2]
        for r in batch(f"b{seed}", seed):
            driver.add_request(r)
        first = True
        while driver.has_unfinished():
            spent.clear()
            start = clock()
            outs = driver.step()
            elapsed = clock() - start
            if record and not first:
                steps[name].append(elapsed * 1e3)
                for key in PARTS:
                    parts[name][key].append(spent.get(key, 0.0) * 1e3)
            first = False
            for o in sorted(outs, key=lambda o: o.request_id):
                for h in o.hypotheses:
                    digests[name].update(
                        repr((o.request_id, h.token_ids, round(h.score, 4))).encode()
                    )
        assert model.block_pool.num_free == model.block_pool.num_usable, "blocks leaked"

    for name in variants:
        run_batch(name, 0, False)  # warm-up
    for i in range(args.rounds):  # alternating, first one then the other: no order bias
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            run_batch(name, i + 1, True)
    top = None
    if args.profile:
        prof = cProfile.Profile(clock)
        prof.enable()
        run_batch("this", 0, False)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        top = out.getvalue()
        print(top)
    figures: dict[str, Any] = {}
    for name in variants:
        figures[name] = {
            **_summary(steps[name], parts[name]),
            "forks": drivers[name].forks,
            "cow_copies": drivers[name].cow_copies,
            "output_digest": digests[name].hexdigest()[:16],
        }
    if "baseline" in figures:
        this, base = figures["this"], figures["baseline"]
        # The same tokens and scores (on the CPU they must be; a GPU's nondeterministic
        # kernel would show here, recorded rather than losing the run).
        figures["same_outputs"] = this["output_digest"] == base["output_digest"]
        if not figures["same_outputs"]:
            print("WARNING: this tree and the baseline gave different outputs")
        figures["speedup"] = {
            k: base[k] / this[k]
            for k in this
            if k.endswith(("_median", "_p10", "_excl_kv_copy")) and this[k] > 0
        }
    for name, figs in figures.items():
        if not isinstance(figs, dict):
            print(f"{name}: {figs}")
            continue
        print(name)
        for k, v in figs.items():
            print(f"  {k:>28}: {v:.3f}" if isinstance(v, float) else f"  {k:>28}: {v}")
    if not args.no_record:
        path = write_record(
            "profile-beam-host", model_shape=f"tiny-nllb-v{args.vocab}",
            config={**vars(args), "rows": rows, "torch_threads": 1,
                    "clock": clock.__name__, "graph_rungs": graphs.captured_rungs},
            figures=figures, device=args.device, out_dir=args.out_dir, notes=args.notes,
        )  # fmt: skip
        print(path)


if __name__ == "__main__":
    main()
