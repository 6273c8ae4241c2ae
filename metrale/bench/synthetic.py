"""Model directories for benchmarks: a committed `config.json` plus a synthetic tokenizer that
covers the config's whole vocabulary, so `--load-format dummy` runs any real shape offline.

Owner: bench.

Invariants:
- The tokenizer maps every id in `[0, vocab_size)` to a distinct token (a word-level vocabulary
  `t0 .. tN`), so detokenizing random ids never fails. It is generated, deterministically, into
  a temporary copy of the config directory; the repository is never written.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def prepare_model_dir(config_dir: str | Path) -> Path:
    """A directory with the config and a tokenizer: `config_dir` itself if it has one, else a
    temporary copy with a synthetic tokenizer added (removed at exit)."""
    src = Path(config_dir)
    if (src / "tokenizer.json").is_file():
        return src
    dst = Path(tempfile.mkdtemp(prefix=f"metrale-bench-{src.name}-"))
    atexit.register(shutil.rmtree, dst, ignore_errors=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copyfile(f, dst / f.name)
    write_synthetic_tokenizer(dst)
    return dst


def write_synthetic_tokenizer(model_dir: str | Path) -> None:
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    # Multimodal configs (Qwen3-VL) keep the vocabulary size in their text config.
    vocab_size = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIALS)
    tok.save(str(root / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": SPECIALS[0],
                "pad_token": SPECIALS[0],
                "chat_template": template,
            },
            indent=2,
        )
    )
