"""`metrale bench translate`: beam-search translation throughput (sentences per second) of an
M2M100/NLLB checkpoint against a peer on the same checkpoint, device and dtype, in the same run:
CTranslate2 (`--peer ctranslate2`, the CPU default) or transformers'
`M2M100ForConditionalGeneration.generate` (`--peer transformers`, the CUDA default).

Owner: bench.

Invariants:
- Without `--model` the instrument writes a random checkpoint of the chosen shape
  (`--shape tiny-nllb`, or `nllb-600m` = `bench/configs/nllb-200-distilled-600m`, or any
  `--config-dir`) with transformers' `M2M100ForConditionalGeneration` (built on the bench
  device, saved in float32) and a word-level tokenizer whose last two ids are the language
  codes, into a temporary directory removed at exit. Both engines read those same weights.
- Both engines get the same sources, beam width, length penalty, early stopping, length limit
  and batch size, on the same device and dtype; each batch size is timed after one warm-up
  batch, with the device synchronised around the clock. The record says how many best
  hypotheses agreed (float32 agrees token for token; a bfloat16/float16 disagreement is
  reported, not asserted), so a speed figure never hides a different search.
- `--device cuda` never falls back to the CPU: no CUDA device is an error, and the run checks
  that both engines' weights sit on the device asked for (the record names the GPU).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from metrale.bench.record import RECORDS_DIR, write_record
from metrale.cache.block_pool import blocks_for
from metrale.errors import InvalidRequestError

logger = logging.getLogger(__name__)

LANGS = ("eng_Latn", "fra_Latn")
REPO = Path(__file__).resolve().parents[2]
#: `--shape` -> the config.json the random checkpoint is built from (None: `TINY_NLLB`).
SHAPES: dict[str, Path | None] = {
    "tiny-nllb": None,
    "nllb-600m": REPO / "bench" / "configs" / "nllb-200-distilled-600m",
}
#: The default shape: NLLB's layout (scaled embeddings, ReLU, pad 1 / eos 2), 3+3 layers.
TINY_NLLB: dict[str, Any] = {
    "model_type": "m2m_100", "vocab_size": 8192, "d_model": 256, "encoder_layers": 3,
    "decoder_layers": 3, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 1024, "decoder_ffn_dim": 1024, "scale_embedding": True,
    "activation_function": "relu", "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2,
    "decoder_start_token_id": 2, "max_position_embeddings": 256, "init_std": 0.1,
}  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="M2M100/NLLB checkpoint (default: random weights of --shape)"
    )
    p.add_argument(
        "--shape", default="tiny-nllb", choices=sorted(SHAPES),
        help="random-weight shape without --model (default: tiny-nllb; nllb-600m is "
        "NLLB-200-distilled-600M's config)",
    )  # fmt: skip
    p.add_argument(
        "--config-dir", default=None, help="a config.json directory to build instead of --shape"
    )
    p.add_argument(
        "--init-std", type=float, default=None,
        help="weight init std of the random checkpoint (default: 0.1 tiny, 0.05 otherwise)",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="(default: cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="(default: float32)")
    p.add_argument(
        "--peer", default=None, choices=("ctranslate2", "transformers", "none"),
        help="the engine timed beside metrale (default: ctranslate2 on cpu, transformers on cuda)",
    )  # fmt: skip
    p.add_argument(
        "--sentences", type=int, default=32, help="sentences per batch size (default: 32)"
    )
    p.add_argument(
        "--batch1-sentences", type=int, default=None,
        help="sentences at batch size 1 (default: --sentences)",
    )  # fmt: skip
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated (default: 1,16)")
    p.add_argument("--num-beams", type=int, default=4, help="beam width (default: 4)")
    p.add_argument(
        "--max-tokens", type=int, default=32, help="tokens per translation (default: 32)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="CPU threads for both engines (default: 1)"
    )
    p.add_argument("--src", default="eng_Latn", help="source code with --model (default: eng_Latn)")
    p.add_argument("--tgt", default="fra_Latn", help="target code with --model (default: fra_Latn)")
    p.add_argument(
        "--step-graphs", action="store_true",
        help="also time metrale with its decoder step graphed (EncDecStepGraphs; CUDA graphs "
        "on a GPU), as figures[batchN]['step_graphs']",
    )  # fmt: skip
    p.add_argument("--out-dir", default=str(RECORDS_DIR), help="record directory")
    p.add_argument("--notes", default="", help="free text for the record (default: none)")


def shape_config(shape: str, config_dir: str | None) -> tuple[str, dict[str, Any]]:
    """The shape's name and its config.json as a dict."""
    if config_dir is not None:
        path = Path(config_dir)
        return path.name, json.loads((path / "config.json").read_text())
    src = SHAPES[shape]
    return shape, dict(TINY_NLLB) if src is None else json.loads((src / "config.json").read_text())


def build_random_nllb(
    out: Path,
    raw: dict[str, Any],
    *,
    init_std: float | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Path, Any]:
    """Write a random-weight `M2M100ForConditionalGeneration` of config `raw` (dropout off,
    `init_std` if given) and a word-level tokenizer with the language codes `LANGS` as its
    last ids into `out`; returns the directory and the float32 transformers model (on `device`)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    raw.update(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    if init_std is not None:
        raw["init_std"] = init_std
    config = tf.M2M100Config(**raw)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.M2M100ForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    vocab_size = config.vocab_size
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    words = [f"w{i}" for i in range(len(specials), vocab_size - len(LANGS))]
    vocab = {t: i for i, t in enumerate([*specials, *words, *LANGS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([*specials, *LANGS])
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": int(config.max_position_embeddings),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out, model


def build_tiny_nllb(out: Path, vocab_size: int = 8192) -> Path:
    """A random NLLB-shaped checkpoint (3+3 layers, d_model 256) with a word-level tokenizer."""
    return build_random_nllb(out, {**TINY_NLLB, "vocab_size": vocab_size})[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def _ct2_runner(
    model_dir: Path, tmp: Path, args: argparse.Namespace, src_id: int, tgt_id: int, eos: int
) -> Callable[[list[list[int]]], list[list[int]]]:
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    ct2_dir = tmp / "ct2"
    TransformersConverter(str(model_dir)).convert(str(ct2_dir), quantization=args.dtype)
    vocab = json.loads((ct2_dir / "shared_vocabulary.json").read_text())
    index = {t: i for i, t in enumerate(vocab)}
    ct2 = ctranslate2.Translator(str(ct2_dir), device=args.device, compute_type=args.dtype,
                                 intra_threads=args.threads, inter_threads=1)  # fmt: skip

    def run(batch: list[list[int]]) -> list[list[int]]:
        res = ct2.translate_batch(
            [[vocab[t] for t in [src_id, *s, eos]] for s in batch],
            target_prefix=[[vocab[tgt_id]]] * len(batch), beam_size=args.num_beams,
            max_decoding_length=args.max_tokens + 1, min_decoding_length=0,
        )  # fmt: skip
        # CTranslate2 drops the closing EOS: compare without it.
        return [[index[t] for t in r.hypotheses[0]][1:] for r in res]

    return run


def _hf_runner(
    hf: Any, args: argparse.Namespace, src_id: int, tgt_id: int, pad: int, eos: int
) -> Callable[[list[list[int]]], list[list[int]]]:
    device = next(hf.parameters()).device

    @torch.inference_mode()
    def run(batch: list[list[int]]) -> list[list[int]]:
        rows = [[src_id, *s, eos] for s in batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        out = hf.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), num_beams=args.num_beams,
            num_return_sequences=1, max_new_tokens=args.max_tokens + 1, min_new_tokens=0,
            early_stopping=True, length_penalty=1.0, do_sample=False, no_repeat_ngram_size=0,
            forced_bos_token_id=tgt_id,
        )  # fmt: skip
        result = []
        for row in out.tolist():
            gen = row[2:]  # decoder start, then the forced target code
            if eos in gen:  # a finished hypothesis is padded after its EOS
                gen = gen[: gen.index(eos) + 1]
            result.append(gen)
        return result

    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    from metrale.engine.translate import Translator
    from metrale.model_engine.beam import BeamParams
    from metrale.model_engine.factory import resolve_device

    device = resolve_device(args.device)  # cuda without a GPU is an error, never the CPU
    dtype = DTYPES[args.dtype]
    peer = args.peer or ("ctranslate2" if device.type == "cpu" else "transformers")
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="metrale-bench-translate-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    hf = None
    built_start = time.perf_counter()
    if args.model:
        model_dir, shape = Path(args.model), Path(args.model).name
    else:
        shape, raw = shape_config(args.shape, args.config_dir)
        init_std = args.init_std
        if init_std is None:
            init_std = 0.1 if shape == "tiny-nllb" else 0.05
        model_dir, hf = build_random_nllb(tmp / "model", raw, init_std=init_std, device=device)
    build_s = time.perf_counter() - built_start
    if peer == "transformers":
        import transformers as tf

        if hf is None:
            hf = tf.M2M100ForConditionalGeneration.from_pretrained(model_dir)
        hf = hf.to(device=device, dtype=dtype).eval()
        _check_on(hf.parameters(), device, dtype, "the transformers peer")
    else:
        hf = None  # the float32 builder copy is not needed
    blocks_per_beam = blocks_for(args.max_tokens + 2, 16)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    kv_blocks = 2 * max(batch_sizes) * args.num_beams * blocks_per_beam + 64
    ours = Translator(
        model_dir, device=args.device, dtype=args.dtype, num_kv_blocks=kv_blocks, block_size=16,
        max_model_len=max(256, args.max_tokens + 2),
    )  # fmt: skip
    _check_on(ours.model.module.parameters(), device, dtype, "metrale's model")
    cfg = ours.model.config
    src_code, tgt_code = LANGS if args.model is None else (args.src, args.tgt)
    src_id, tgt_id = ours.lang_id(src_code, "src_lang"), ours.lang_id(tgt_code, "tgt_lang")
    eos = cfg.eos_token_id
    params = BeamParams(num_beams=args.num_beams, early_stopping=True, max_tokens=args.max_tokens)

    def runner(t: Translator) -> Callable[[list[list[int]]], list[list[int]]]:
        def run_batch(batch: list[list[int]]) -> list[list[int]]:
            reqs = [t.request(s, src_code, tgt_code, params) for s in batch]
            return [o.hypotheses[0].token_ids for o in t.run(reqs)]

        return run_batch

    run_ours = runner(ours)
    graphed: Translator | None = None
    graph_info: Any = None
    graphs_error: str | None = None
    if args.step_graphs:
        try:
            # The graphs' widths follow this run: decoder length max_tokens + 2, sources of at
            # most 26 tokens, every beam of the largest batch in one step.
            graphed = Translator(
                model_dir, device=args.device, dtype=args.dtype, num_kv_blocks=kv_blocks,
                block_size=16, max_model_len=args.max_tokens + 2,
            )  # fmt: skip
            graph_info = graphed.model.enable_step_graphs(
                max_rows=max(batch_sizes) * args.num_beams, max_sources=max(batch_sizes),
                source_cap=32,
            )  # fmt: skip
        except Exception as exc:  # recorded and printed: the eager figures still stand
            graphs_error = f"{type(exc).__name__}: {exc}"
            logger.exception("step graphs could not be built")
            graphed = None

    peer_run: Callable[[list[list[int]]], list[list[int]]] | None = None
    if peer == "ctranslate2":
        peer_run = _ct2_runner(model_dir, tmp, args, src_id, tgt_id, eos)
    elif peer == "transformers":
        peer_run = _hf_runner(hf, args, src_id, tgt_id, cfg.pad_token_id, eos)

    rng = random.Random(0)
    pool = list(range(4, cfg.vocab_size - len(LANGS)))
    most = max(args.sentences, args.batch1_sentences or 0)
    sources = [[rng.choice(pool) for _ in range(rng.randrange(8, 25))] for _ in range(most)]

    def timed(fn: Callable[[list[list[int]]], list[list[int]]], batches: list[list[list[int]]],
              n: int) -> tuple[dict[str, Any], list[list[int]]]:  # fmt: skip
        fn(batches[0])  # warm-up
        _sync(device)
        start = time.perf_counter()
        outs = [o for b in batches for o in fn(b)]
        _sync(device)
        elapsed = time.perf_counter() - start
        fig = {"sentences": n, "sentences_per_s": n / elapsed, "seconds": elapsed,
               "mean_output_tokens": sum(len(o) for o in outs) / max(1, len(outs))}  # fmt: skip
        return fig, outs

    figures: dict[str, Any] = {}
    peers: dict[str, Any] = {}
    for bs in batch_sizes:
        n = args.batch1_sentences if bs == 1 and args.batch1_sentences else args.sentences
        batches = [sources[i : i + bs] for i in range(0, n, bs)]
        key = f"batch{bs}"
        figures[key], ours_out = timed(run_ours, batches, n)
        figures[key]["decoder_forwards_last_batch"] = ours.last_stats.get("forwards", 0)
        graphed_out = None
        if graphed is not None:
            graphs = graphed.model.step_graphs
            assert graphs is not None
            before = (graphs.replays, graphs.eager_forwards)
            try:
                sub, graphed_out = timed(runner(graphed), batches, n)
            except Exception as exc:  # recorded and printed; the eager figures still stand
                graphs_error = f"batch {bs}: {type(exc).__name__}: {exc}"
                logger.exception("the graphed run failed")
                figures[key]["step_graphs"] = {"error": graphs_error}
                graphed = None
            else:
                sub["graph_replays"] = graphs.replays - before[0]
                sub["eager_forwards"] = graphs.eager_forwards - before[1]
                sub["top_hypothesis_agrees_with_eager"] = (
                    f"{sum(x == y for x, y in zip(graphed_out, ours_out, strict=True))}/{n}"
                )
                figures[key]["step_graphs"] = sub
        if peer_run is None:
            continue
        peers[key], peer_out = timed(peer_run, batches, n)
        for fig, out in ((figures[key], ours_out), (figures[key].get("step_graphs"), graphed_out)):
            if fig is None or out is None or "error" in fig:
                continue
            if peer == "ctranslate2":
                out = [_strip_eos(x, eos) for x in out]
            same = sum(x == y for x, y in zip(out, peer_out, strict=True))
            fig[f"top_hypothesis_agrees_with_{peer}"] = f"{same}/{n}"
            fig[f"ratio_vs_{peer}"] = fig["sentences_per_s"] / peers[key]["sentences_per_s"]
    config = {k: v for k, v in vars(args).items() if k not in ("handler",)}
    config.update(
        peer=peer, device=str(device), dtype=args.dtype, d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers,
        vocab_size=cfg.vocab_size, kv_blocks=kv_blocks, build_seconds=round(build_s, 1),
        kernels=sorted(set(ours.model.module.ops.implementations.values())),
    )  # fmt: skip
    if device.type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(device)
    if args.step_graphs:
        config["step_graphs"] = (
            {"rungs": graph_info.rungs, "capture_seconds": round(graph_info.capture_seconds, 2),
             "captured": graph_info.captured_rungs, "error": graphs_error}
            if graph_info is not None else {"error": graphs_error}
        )  # fmt: skip
    path = write_record(
        "translate", model_shape=shape, config=config, figures=figures,
        peer_figures=peers or None, device=args.device, out_dir=args.out_dir, notes=args.notes,
    )  # fmt: skip
    print(f"device {device} ({config.get('gpu', 'cpu')}), dtype {args.dtype}, peer {peer}")
    print(f"{'batch':>6} {'metrale sent/s':>15} {'peer sent/s':>12} {'ratio':>7} agree")
    for key, fig in figures.items():
        p = peers.get(key)
        for label, f in ((key[5:], fig), (f"{key[5:]}g", fig.get("step_graphs"))):
            if f is None or "error" in f:
                continue
            print(
                f"{label:>6} {f['sentences_per_s']:15.2f} "
                + (f"{p['sentences_per_s']:12.2f} {f[f'ratio_vs_{peer}']:7.2f} "
                   f"{f[f'top_hypothesis_agrees_with_{peer}']}" if p else f"{'-':>12}")
            )  # fmt: skip
    if args.step_graphs:
        print(f"(Ng: the decoder step graphed) {config['step_graphs']}")
    print(f"record: {path}")
    return figures


def _check_on(params: Any, device: torch.device, dtype: torch.dtype, what: str) -> None:
    """Refuse a run whose weights are not where (or what) they were asked to be."""
    for p in params:
        if p.device.type != device.type or p.dtype != dtype:
            raise InvalidRequestError(
                f"{what} has a weight on {p.device} in {p.dtype}, not {device} in {dtype}",
                param="device",
            )
