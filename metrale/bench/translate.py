"""`metrale bench translate`: beam-search translation throughput (sentences per second) of an
M2M100/NLLB checkpoint against CTranslate2 on the same checkpoint, in the same run.

Owner: bench.

Invariants:
- Without `--model` the instrument writes a random NLLB-shaped checkpoint (transformers'
  `M2M100ForConditionalGeneration`, scaled embeddings, ReLU, pad 1 / eos 2; a word-level
  tokenizer with two language codes) into a temporary directory removed at exit.
- Both engines get the same sources, beam width, length penalty and length limit and the
  same thread count; each batch size is timed after one warm-up batch. The record says how
  many best hypotheses agreed, so a speed figure never hides a different search.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from metrale.bench.record import write_record

LANGS = ("eng_Latn", "fra_Latn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="M2M100/NLLB checkpoint (default: random tiny NLLB shape)"
    )
    p.add_argument(
        "--sentences", type=int, default=32, help="sentences per batch size (default: 32)"
    )
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
    p.add_argument("--notes", default="", help="free text for the record (default: none)")


def build_tiny_nllb(out: Path, vocab_size: int = 8192) -> Path:
    """A random NLLB-shaped checkpoint (3+3 layers, d_model 256) with a word-level tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = tf.M2M100Config(
        vocab_size=vocab_size, d_model=256, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=1024,
        decoder_ffn_dim=1024, scale_embedding=True, activation_function="relu",
        bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        max_position_embeddings=256, init_std=0.1, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    tf.M2M100ForConditionalGeneration(config).eval().save_pretrained(out)
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
        "model_max_length": 256,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


def run(args: argparse.Namespace) -> None:
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    from metrale.engine.translate import Translator
    from metrale.model_engine.beam import BeamParams

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="metrale-bench-translate-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model_dir = Path(args.model) if args.model else build_tiny_nllb(tmp / "model")
    ct2_dir = tmp / "ct2"
    TransformersConverter(str(model_dir)).convert(str(ct2_dir), quantization="float32")
    vocab = json.loads((ct2_dir / "shared_vocabulary.json").read_text())
    ct2 = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32",
                                 intra_threads=args.threads, inter_threads=1)  # fmt: skip
    ours = Translator(model_dir, device="cpu", dtype="float32", num_kv_blocks=8192, block_size=16)
    cfg = ours.model.config
    src_code, tgt_code = LANGS if args.model is None else (args.src, args.tgt)
    src_id, tgt_id = ours.lang_id(src_code, "src_lang"), ours.lang_id(tgt_code, "tgt_lang")
    rng = random.Random(0)
    pool = list(range(4, cfg.vocab_size - len(LANGS)))
    sources = [
        [rng.choice(pool) for _ in range(rng.randrange(8, 25))] for _ in range(args.sentences)
    ]
    params = BeamParams(num_beams=args.num_beams, early_stopping=True, max_tokens=args.max_tokens)

    def run_ours(batch: list[list[int]]) -> list[list[int]]:
        reqs = [ours.request(s, src_code, tgt_code, params) for s in batch]
        return [o.hypotheses[0].token_ids for o in ours.run(reqs)]

    def run_ct2(batch: list[list[int]]) -> list[list[int]]:
        res = ct2.translate_batch(
            [[vocab[t] for t in [src_id, *s, cfg.eos_token_id]] for s in batch],
            target_prefix=[[vocab[tgt_id]]] * len(batch), beam_size=args.num_beams,
            max_decoding_length=args.max_tokens + 1, min_decoding_length=0,
        )  # fmt: skip
        index = {t: i for i, t in enumerate(vocab)}
        return [[index[t] for t in r.hypotheses[0]][1:] for r in res]

    figures: dict[str, Any] = {}
    peers: dict[str, Any] = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        batches = [sources[i : i + bs] for i in range(0, len(sources), bs)]
        for fn, sink in ((run_ours, figures), (run_ct2, peers)):
            fn(batches[0])  # warm-up
            start = time.perf_counter()
            outs = [o for b in batches for o in fn(b)]
            elapsed = time.perf_counter() - start
            sink[f"batch{bs}"] = {"sentences_per_s": len(sources) / elapsed, "seconds": elapsed}
            sink[f"batch{bs}"]["_outs"] = outs
        a, b = figures[f"batch{bs}"].pop("_outs"), peers[f"batch{bs}"].pop("_outs")
        same = sum((x[:-1] if x and x[-1] == cfg.eos_token_id else x) == y for x, y in zip(a, b))
        figures[f"batch{bs}"]["top_hypothesis_agrees_with_ctranslate2"] = f"{same}/{len(a)}"
        figures[f"batch{bs}"]["ratio_vs_ctranslate2"] = (
            figures[f"batch{bs}"]["sentences_per_s"] / peers[f"batch{bs}"]["sentences_per_s"]
        )
    shape = "tiny-nllb" if args.model is None else model_dir.name
    config = {k: v for k, v in vars(args).items() if k not in ("handler",)}
    config.update(d_model=cfg.d_model, encoder_layers=cfg.encoder_layers,
                  decoder_layers=cfg.decoder_layers, vocab_size=cfg.vocab_size)  # fmt: skip
    path = write_record("translate", model_shape=shape, config=config, figures=figures,
                        peer_figures=peers, device="cpu", notes=args.notes)  # fmt: skip
    print(f"{'batch':>6} {'metrale sent/s':>15} {'ct2 sent/s':>11} {'ratio':>6} agree")
    for key, fig in figures.items():
        print(f"{key[5:]:>6} {fig['sentences_per_s']:15.2f} {peers[key]['sentences_per_s']:11.2f} "
              f"{fig['ratio_vs_ctranslate2']:6.2f} {fig['top_hypothesis_agrees_with_ctranslate2']}")  # fmt: skip
    print(f"record: {path}")
