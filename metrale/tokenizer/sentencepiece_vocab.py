"""M2M100's sentencepiece tokenizer layout (`sentencepiece.bpe.model` + `vocab.json`, no
`tokenizer.json`): `SentencePieceVocab`, the part of `Tokenizer`'s interface translation uses.

Owner: tokenizer. `metrale.engine.translate.Translator` loads it when a checkpoint has these
files and no `tokenizer.json`.

Invariants:
- Text is split by the checkpoint's sentencepiece model and each piece mapped through
  `vocab.json` (a piece it lacks is `<unk>`), as fairseq and transformers' slow
  `M2M100Tokenizer` do; ids are never renumbered.
- Language codes are the `__xx__` entries of the checkpoint's `additional_special_tokens`
  (`tokenizer_config.json` or `special_tokens_map.json`), in order, with ids right after
  `vocab.json`'s; a checkpoint whose files list none is refused naming what is missing
  (metrale carries no built-in language list).
- Importing this module does not import sentencepiece; `from_dir` does, and says how to
  install it when it is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from metrale.errors import CheckpointError

SPM_FILE = "sentencepiece.bpe.model"
VOCAB_FILE = "vocab.json"


def has_sentencepiece_layout(path: str | Path) -> bool:
    root = Path(path)
    return (
        not (root / "tokenizer.json").is_file()
        and (root / SPM_FILE).is_file()
        and (root / VOCAB_FILE).is_file()
    )


def _language_codes(root: Path) -> list[str]:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = root / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
        entries = data.get("additional_special_tokens") or []
        codes = []
        for e in entries:
            text = e.get("content") if isinstance(e, dict) else e
            if isinstance(text, str) and text.startswith("__") and text.endswith("__"):
                codes.append(text)
        if codes:
            return codes
    raise CheckpointError(
        f"{root}: the sentencepiece tokenizer files list no language codes "
        "(additional_special_tokens such as '__en__' in tokenizer_config.json or "
        "special_tokens_map.json)"
    )


class SentencePieceVocab:
    """Encode, decode and look up tokens of an M2M100 sentencepiece checkpoint."""

    def __init__(self, processor: Any, encoder: dict[str, int], languages: Sequence[str]) -> None:
        self._sp = processor
        self._encoder = dict(encoder)
        base = len(self._encoder)
        self._lang_ids = {code: base + i for i, code in enumerate(languages)}
        self._decoder = {i: t for t, i in self._encoder.items()}
        self._decoder.update({i: t for t, i in self._lang_ids.items()})
        self._unk = self._encoder.get("<unk>", 3)
        self._eos = self._encoder.get("</s>", 2)
        specials = {"<s>", "<pad>", "</s>", "<unk>"}
        self._special_ids = frozenset(
            [self._encoder[t] for t in specials if t in self._encoder]
            + list(self._lang_ids.values())
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> SentencePieceVocab:
        root = Path(path)
        try:
            import sentencepiece
        except ImportError as exc:
            raise CheckpointError(
                f"{root} holds a sentencepiece tokenizer ({SPM_FILE}); reading it needs the "
                "sentencepiece package (pip install sentencepiece)"
            ) from exc
        try:
            encoder = json.loads((root / VOCAB_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                f"{root / VOCAB_FILE}: cannot read the vocabulary ({exc})"
            ) from exc
        processor = sentencepiece.SentencePieceProcessor()
        if not processor.Load(str(root / SPM_FILE)):
            raise CheckpointError(f"{root / SPM_FILE}: not a sentencepiece model")
        return cls(processor, encoder, _language_codes(root))

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self._eos})

    @property
    def language_codes(self) -> tuple[str, ...]:
        return tuple(self._lang_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's piece ids (no language code or EOS: the caller adds those)."""
        pieces = self._sp.encode(text, out_type=str)
        return [self._encoder.get(p, self._unk) for p in pieces]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces = []
        out = ""
        for i in ids:
            if i in self._special_ids:
                if skip_special_tokens:
                    continue
                out += self._sp.decode(pieces) + self._decoder.get(i, "")
                pieces = []
                continue
            pieces.append(self._decoder.get(i, "<unk>"))
        return out + self._sp.decode(pieces)

    def token_to_id(self, token: str) -> int | None:
        if token in self._lang_ids:
            return self._lang_ids[token]
        return self._encoder.get(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._decoder.get(i) for i in ids]
