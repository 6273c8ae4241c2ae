"""The tiny byte-level BPE tokenizer every test checkpoint uses, trained locally.

Owner: tokenizer package. Tests, tiny model fixtures and benchmarks call `build_tokenizer`,
`tokenizer_files` or `copy_tokenizer_into`; nothing is downloaded.

Invariants:
- Training reads the CPython stdlib `*.py` files directly in `sysconfig.get_paths()["stdlib"]`,
  sorted, so one interpreter always produces the same vocabulary and merges.
- Special tokens are ids 0..5 in this order: <pad> (0), <s> (1, bos), </s> (2, eos), <unk> (3),
  <|im_start|> (4), <|im_end|> (5). The post-processor puts <s> in front of every encoding.
- The files are written without transformers (a test-only dependency), in the layout the Hub
  uses: `tokenizer.json` plus `tokenizer_config.json` with the ChatML template inline (classic,
  transformers 4.x) or in `chat_template.jinja` (transformers 5.x, `template_file=True`).
- `tokenizer_files` builds each variant at most once per process, into a private temporary
  directory that is removed at exit; callers must treat that directory as read-only.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import shutil
import sysconfig
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

logger = logging.getLogger(__name__)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
)
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
UNK_TOKEN_ID = 3
IM_START_TOKEN_ID = 4
IM_END_TOKEN_ID = 5

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def _training_files() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no *.py files found in the stdlib directory {stdlib}")
    return files


def _train(vocab_size: int) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is below the byte alphabet plus specials "
            f"({256 + len(SPECIAL_TOKENS)})"
        )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual = tok.token_to_id(token)
        if actual != expected_id:
            raise RuntimeError(f"special token {token!r} got id {actual}, expected {expected_id}")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", BOS_TOKEN_ID)],
    )
    return tok


def _added_tokens_decoder() -> dict[str, dict[str, object]]:
    return {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }


def _tokenizer_config(template_file: bool, model_max_length: int) -> dict[str, object]:
    config: dict[str, object] = {
        "added_tokens_decoder": _added_tokens_decoder(),
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "model_max_length": model_max_length,
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    if template_file:
        # transformers 5.x layout: named backend, extra specials, template in chat_template.jinja.
        config["backend"] = "tokenizers"
        config["extra_special_tokens"] = list(SPECIAL_TOKENS[4:])
        config["tokenizer_class"] = "TokenizersBackend"
    else:
        # transformers 4.x layout, which 5.x still loads.
        config["additional_special_tokens"] = list(SPECIAL_TOKENS[4:])
        config["chat_template"] = CHATML_TEMPLATE
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return config


def build_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 512,
    *,
    template_file: bool = False,
    model_max_length: int = 512,
) -> None:
    """Train the tiny tokenizer and write its files into `out_dir` (created if missing).

    With `template_file=True` the chat template goes to `chat_template.jinja` (transformers 5
    layout) instead of inline in `tokenizer_config.json`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _train(vocab_size).save(str(out / "tokenizer.json"))
    _write_config_files(out, template_file=template_file, model_max_length=model_max_length)
    logger.debug("wrote tiny tokenizer (vocab %d) to %s", vocab_size, out)


def _write_config_files(out: Path, *, template_file: bool, model_max_length: int) -> None:
    config = _tokenizer_config(template_file, model_max_length)
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    template_path = out / "chat_template.jinja"
    if template_file:
        template_path.write_text(CHATML_TEMPLATE, encoding="utf-8")
    elif template_path.exists():
        template_path.unlink()  # a stale file would override the inline template


def tokenizer_files(vocab_size: int = 512, *, template_file: bool = False) -> Path:
    """Directory holding the tiny tokenizer's files, built once per process; do not modify it."""
    return _cached_files(int(vocab_size), bool(template_file))


@functools.cache
def _cached_files(vocab_size: int, template_file: bool) -> Path:
    # Positional, normalized arguments only: functools.cache keys on how a call is spelled.
    tmp = Path(tempfile.mkdtemp(prefix=f"metrale-tiny-tokenizer-{vocab_size}-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    if template_file:
        # Same vocabulary, other layout: reuse the trained tokenizer.json instead of retraining.
        shutil.copyfile(_cached_files(vocab_size, False) / "tokenizer.json", tmp / "tokenizer.json")
        _write_config_files(tmp, template_file=True, model_max_length=512)
    else:
        build_tokenizer(tmp, vocab_size)
    return tmp


def copy_tokenizer_into(
    dst_dir: str | Path, vocab_size: int = 512, *, template_file: bool = False
) -> Path:
    """Copy the (cached) tiny tokenizer's files into `dst_dir`, e.g. a tiny model checkpoint."""
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    src = tokenizer_files(vocab_size, template_file=template_file)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
        elif (dst / name).exists():
            (dst / name).unlink()  # a stale chat_template.jinja would override the inline one
    return dst
