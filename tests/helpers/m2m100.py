"""Tiny random M2M100 / NLLB checkpoints and their tokenizers, written by transformers.

Owner: tests. `build(variant)` writes a real `M2M100ForConditionalGeneration` checkpoint
(config.json, model.safetensors, generation_config.json) plus a `tokenizer.json` whose
language codes are special tokens after the tiny BPE vocabulary (ids 512, 513, ...), and
whose specials take M2M100's ids (<s> 0, <pad> 1, </s> 2, <unk> 3), so CTranslate2's
converter (which assumes positions start at 2, i.e. pad id 1) reads the checkpoint right.
`build_spm()` writes an M2M100 checkpoint with the sentencepiece layout instead
(`sentencepiece.bpe.model` + `vocab.json`, saved by transformers' `M2M100Tokenizer`).

Invariants:
- Deterministic: a variant always gets the same weights (seeded init); the EOS row of the
  shared embedding is scaled up so hypotheses end by EOS as well as by length.
- Built once per process per variant into a temporary directory removed at exit; callers
  must not modify it.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.tiny_tokenizer import (
    EOS_TOKEN_ID,
    SPECIAL_TOKENS,
    tokenizer_files,
)

BASE_VOCAB = 512
BOS_ID, PAD_ID = 0, 1  # the M2M100 order (the tiny tokenizer's two are swapped)


@dataclass(frozen=True)
class EncDecVariant:
    name: str
    languages: tuple[str, ...]
    config: tuple[tuple[str, Any], ...]
    seed: int = 0
    init_std: float = 0.25
    eos_scale: float = 1.4

    @property
    def vocab_size(self) -> int:
        return BASE_VOCAB + len(self.languages)

    def lang_id(self, code: str) -> int:
        return BASE_VOCAB + self.languages.index(code)


#: A plain M2M100 layout (`__xx__` codes, unscaled embeddings, GELU) and an NLLB-200 style one
#: (`xxx_Latn` codes, scaled embeddings, ReLU, more encoder than decoder layers).
M2M100_PLAIN = EncDecVariant(
    "m2m100-plain",
    ("__en__", "__fr__", "__de__", "__es__"),
    (("d_model", 64), ("encoder_layers", 2), ("decoder_layers", 2), ("encoder_attention_heads", 4), ("decoder_attention_heads", 4), ("encoder_ffn_dim", 128), ("decoder_ffn_dim", 128), ("scale_embedding", False), ("activation_function", "gelu")),
)  # fmt: skip
NLLB_STYLE = EncDecVariant(
    "nllb-style",
    ("eng_Latn", "fra_Latn", "deu_Latn", "zho_Hans"),
    (("d_model", 48), ("encoder_layers", 3), ("decoder_layers", 2), ("encoder_attention_heads", 4), ("decoder_attention_heads", 4), ("encoder_ffn_dim", 96), ("decoder_ffn_dim", 96), ("scale_embedding", True), ("activation_function", "relu")),
    seed=1,
)  # fmt: skip
VARIANTS = (M2M100_PLAIN, NLLB_STYLE)


def write_tokenizer(out: Path, languages: tuple[str, ...]) -> None:
    """The tiny BPE tokenizer with `languages` appended as special tokens; encoding adds
    `</s>` after the text (the caller puts the source language code first)."""
    from tokenizers import Tokenizer, processors

    raw = json.loads((tokenizer_files() / "tokenizer.json").read_text())
    # M2M100/NLLB order their specials <s> (0), <pad> (1), </s> (2), <unk> (3).
    vocab = raw["model"]["vocab"]
    vocab["<s>"], vocab["<pad>"] = 0, 1
    for added in raw["added_tokens"]:
        if added["content"] in ("<s>", "<pad>"):
            added["id"] = vocab[added["content"]]
    raw["post_processor"] = None
    tok = Tokenizer.from_str(json.dumps(raw))
    tok.add_special_tokens(list(languages))
    for i, code in enumerate(languages):
        assert tok.token_to_id(code) == BASE_VOCAB + i, code
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A $B </s>", special_tokens=[("</s>", EOS_TOKEN_ID)]
    )
    tok.save(str(out / "tokenizer.json"))
    specials = ["<s>", "<pad>", *SPECIAL_TOKENS[2:], *languages]
    ids = [*range(len(SPECIAL_TOKENS)), *range(BASE_VOCAB, BASE_VOCAB + len(languages))]
    config = {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in zip(ids, specials)
        },
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_checkpoint(variant: EncDecVariant, out: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(variant.seed)
    config = tf.M2M100Config(
        vocab_size=variant.vocab_size,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_TOKEN_ID,
        decoder_start_token_id=EOS_TOKEN_ID,
        max_position_embeddings=256,
        init_std=variant.init_std,
        dropout=0.0,
        attention_dropout=0.0,
        **dict(variant.config),
    )
    model = tf.M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.shared.weight[EOS_TOKEN_ID] *= variant.eos_scale
    model.save_pretrained(out)
    write_tokenizer(out, variant.languages)
    return out


@functools.cache
def build(variant: EncDecVariant) -> Path:
    """The checkpoint directory of `variant`, built once per process; do not modify it."""
    out = Path(tempfile.mkdtemp(prefix=f"metrale-{variant.name}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return write_checkpoint(variant, out)


def load_hf(path: Path) -> Any:
    import torch
    import transformers as tf

    return tf.M2M100ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


#: The language codes of the sentencepiece checkpoint: transformers' "wmt21" set, in its order.
SPM_LANGUAGES = ("__en__", "__ha__", "__is__", "__ja__", "__cs__", "__ru__", "__zh__", "__de__")


def write_spm_tokenizer(out: Path) -> int:
    """M2M100's sentencepiece layout, as transformers' `M2M100Tokenizer` saves it (plus the
    `additional_special_tokens` list transformers 4.x wrote): a BPE sentencepiece model trained
    on a few stdlib files, `vocab.json` in fairseq's order; returns the model's vocab size
    (vocabulary + language codes + 8 made-up words)."""
    import sysconfig

    import sentencepiece as spm
    import transformers as tf

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:30]
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(f.read_text(errors="ignore") for f in files))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "sp"), vocab_size=400, model_type="bpe",
        character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1, minloglevel=2,
        num_threads=1,
    )  # fmt: skip
    corpus.unlink()
    sp = spm.SentencePieceProcessor(model_file=str(out / "sp.model"))
    encoder = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        if sp.id_to_piece(i) != "<unk>":
            encoder[sp.id_to_piece(i)] = len(encoder)
    (out / "fairseq-vocab.json").write_text(json.dumps(encoder))
    tok = tf.M2M100Tokenizer(
        str(out / "fairseq-vocab.json"), str(out / "sp.model"), language_codes="wmt21"
    )
    tok.save_pretrained(out)
    for name in ("sp.model", "sp.vocab", "fairseq-vocab.json"):
        (out / name).unlink()
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["additional_special_tokens"] = list(SPM_LANGUAGES)
    config_path.write_text(json.dumps(config, indent=2))
    return len(encoder) + len(SPM_LANGUAGES) + 8


@functools.cache
def build_spm() -> Path:
    """An M2M100 checkpoint with the sentencepiece tokenizer layout (no tokenizer.json)."""
    import torch
    import transformers as tf

    out = Path(tempfile.mkdtemp(prefix="metrale-m2m100-spm-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    vocab_size = write_spm_tokenizer(out)
    torch.manual_seed(2)
    config = tf.M2M100Config(
        vocab_size=vocab_size, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_TOKEN_ID, decoder_start_token_id=EOS_TOKEN_ID,
        max_position_embeddings=256, init_std=0.25, dropout=0.0, attention_dropout=0.0,
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
    )  # fmt: skip
    model = tf.M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.shared.weight[EOS_TOKEN_ID] *= 1.4
    model.save_pretrained(out)
    return out
