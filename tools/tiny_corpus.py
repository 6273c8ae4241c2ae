"""Corpus and tokenizer for `metrale-tiny-code` (issue 6).

Owns the deterministic construction of the training corpus from the CPython standard library
of the interpreter that runs it, its split into train / dev / validation, the corpus hash, and
the byte-level BPE tokenizer (trained with the `tokenizers` library on the train split only).

Invariants:
- Files are `*.py` regular files (no symlinks) under `sysconfig.get_path("stdlib")`, skipping
  any `site-packages` / `dist-packages` / `__pycache__` directory, visited in sorted POSIX path
  order; files that are empty or not valid UTF-8 are skipped (and counted).
- Exact duplicates (same bytes) are dropped: held-out files first claim their contents, then
  dev files, then training files in path order; a training file whose bytes equal a held-out
  or dev file is dropped, so no held-out text is trained on.
- VALIDATION_MODULES (the held-out set of the model card) and DEV_MODULES (used only to pick
  between configurations trained side by side) are excluded from tokenizer and model training,
  together with their unit tests (`test/test_<name>.py`, `test/test_<name>/`).
- The corpus hash is the SHA-256 of the lines `split\\tpath\\tsha256(bytes)\\n` over every kept
  file, in order; equal hashes mean byte-identical splits.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Held-out validation modules: present in CPython 3.11 and 3.12 (and in Debian/Ubuntu's
# libpython3.x-stdlib). A name ending in "/" is a package (every *.py below it).
VALIDATION_MODULES: tuple[str, ...] = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "csv.py",
    "difflib.py",
    "fnmatch.py",
    "fractions.py",
    "glob.py",
    "graphlib.py",
    "heapq.py",
    "ipaddress.py",
    "json/",
    "pprint.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)

# Selection ("dev") modules: excluded from training like the validation set, used only to
# choose between configurations trained in the same device call, never reported as the
# validation figure.
DEV_MODULES: tuple[str, ...] = (
    "configparser.py",
    "gettext.py",
    "queue.py",
    "sched.py",
    "tabnanny.py",
    "zipapp.py",
)

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2

# The Qwen2/Qwen3 pre-tokenizer split (single digits, words with one leading non-letter,
# punctuation runs, newline runs, whitespace runs that leave one space for the next word).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class CorpusFile:
    """One kept source file: its path relative to the stdlib root and its text."""

    path: str
    text: str
    sha256: str

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass
class Corpus:
    """The three splits, the stdlib root they came from and the skip counters."""

    root: str
    train: list[CorpusFile] = field(default_factory=list)
    dev: list[CorpusFile] = field(default_factory=list)
    validation: list[CorpusFile] = field(default_factory=list)
    skipped_empty: int = 0
    skipped_not_utf8: int = 0
    skipped_duplicate: int = 0
    skipped_tests_of_heldout: int = 0

    def corpus_hash(self) -> str:
        h = hashlib.sha256()
        for split, files in (
            ("train", self.train),
            ("dev", self.dev),
            ("validation", self.validation),
        ):
            for f in files:
                h.update(f"{split}\t{f.path}\t{f.sha256}\n".encode())
        return h.hexdigest()

    def stats(self) -> dict[str, object]:
        def _s(files: Sequence[CorpusFile]) -> dict[str, int]:
            return {"files": len(files), "bytes": sum(f.num_bytes for f in files)}

        return {
            "stdlib_root": self.root,
            "corpus_sha256": self.corpus_hash(),
            "train": _s(self.train),
            "dev": _s(self.dev),
            "validation": _s(self.validation),
            "skipped_empty": self.skipped_empty,
            "skipped_not_utf8": self.skipped_not_utf8,
            "skipped_duplicate": self.skipped_duplicate,
            "skipped_tests_of_heldout": self.skipped_tests_of_heldout,
            "validation_modules": list(VALIDATION_MODULES),
            "dev_modules": list(DEV_MODULES),
        }


def default_stdlib_root() -> str:
    """The running interpreter's standard-library directory (the base one inside a venv)."""
    return sysconfig.get_path("stdlib")


def _list_py_files(root: Path) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                continue
            out.append(full.relative_to(root).as_posix())
    return sorted(out)


def _matches(rel: str, modules: Sequence[str]) -> bool:
    for m in modules:
        if m.endswith("/"):
            if rel.startswith(m):
                return True
        elif rel == m:
            return True
    return False


def _is_test_of(rel: str, modules: Sequence[str]) -> bool:
    """True for `test/test_<name>.py` and `test/test_<name>/...` of a listed module."""
    if not rel.startswith("test/"):
        return False
    tail = rel[len("test/") :]
    for m in modules:
        name = m.rstrip("/").removesuffix(".py")
        if tail == f"test_{name}.py" or tail.startswith(f"test_{name}/"):
            return True
    return False


def build_corpus(root: str | None = None, max_train_files: int | None = None) -> Corpus:
    """Read, filter, deduplicate and split the stdlib under `root` (default: this interpreter's).

    `max_train_files` keeps only the first N training files (path order): smoke runs only.
    Raises FileNotFoundError if a validation module is missing.
    """
    root_path = Path(root or default_stdlib_root()).resolve()
    corpus = Corpus(root=str(root_path))
    rels = _list_py_files(root_path)
    texts: dict[str, tuple[str, str]] = {}
    for rel in rels:
        data = (root_path / rel).read_bytes()
        if not data.strip():
            corpus.skipped_empty += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            corpus.skipped_not_utf8 += 1
            continue
        texts[rel] = (text, hashlib.sha256(data).hexdigest())

    for m in VALIDATION_MODULES:
        if not any(_matches(rel, [m]) for rel in texts):
            raise FileNotFoundError(f"validation module {m!r} not found under {root_path}")

    seen: set[str] = set()
    val_rels = [r for r in texts if _matches(r, VALIDATION_MODULES)]
    dev_rels = [r for r in texts if _matches(r, DEV_MODULES)]
    heldout = set(val_rels) | set(dev_rels)
    for rels_split, dest in ((val_rels, corpus.validation), (dev_rels, corpus.dev)):
        for rel in rels_split:
            text, digest = texts[rel]
            if digest in seen:
                corpus.skipped_duplicate += 1
                continue
            seen.add(digest)
            dest.append(CorpusFile(rel, text, digest))
    for rel, (text, digest) in texts.items():
        if rel in heldout:
            continue
        if _is_test_of(rel, VALIDATION_MODULES + DEV_MODULES):
            corpus.skipped_tests_of_heldout += 1
            continue
        if digest in seen:
            corpus.skipped_duplicate += 1
            continue
        seen.add(digest)
        corpus.train.append(CorpusFile(rel, text, digest))
    if max_train_files is not None:
        corpus.train = corpus.train[:max_train_files]
    return corpus


def train_tokenizer(texts: Sequence[str], vocab_size: int = 8192):  # -> tokenizers.Tokenizer
    """Byte-level BPE with the three special tokens at ids 0, 1, 2. Deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = None
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """tokenizer_config.json: PreTrainedTokenizerFast, ChatML template, no BOS/EOS added."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "errors": "replace",
        "split_special_tokens": False,
        "extra_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, s in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": CHAT_TEMPLATE,
    }


def token_stream(tok, files: Sequence[CorpusFile]) -> list[int]:  # tok: tokenizers.Tokenizer
    """`<|endoftext|>` d1 `<|endoftext|>` d2 ... dn `<|endoftext|>`: each document's tokens
    between separators, so every text token and every separator after the first has context."""
    encs = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    out: list[int] = [ENDOFTEXT_ID]
    for e in encs:
        out.extend(e.ids)
        out.append(ENDOFTEXT_ID)
    return out


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Print the tiny-code corpus statistics and hash.")
    p.add_argument("--stdlib", default=None, help="stdlib root (default: this interpreter's)")
    args = p.parse_args()
    c = build_corpus(args.stdlib)
    print(json.dumps(c.stats(), indent=1))


if __name__ == "__main__":
    main()
