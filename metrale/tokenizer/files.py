"""Reading a checkpoint's tokenizer files: `tokenizer.json` plus the Hub's side files
(`tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json` / `config.json`,
chat templates), without transformers.

Owner: tokenizer package. `read_tokenizer_dir` returns the backend and the constructor
arguments of `Tokenizer`; `Tokenizer.from_dir` is its one caller.

Invariants:
- Special tokens come from `tokenizer_config.json` (strings or AddedToken dicts), completed by
  `special_tokens_map.json` (which wins when the config has no `added_tokens_decoder`, as in
  HF); `added_tokens_decoder` entries missing from the backend are added at their ids.
- Extra eos ids come from `generation_config.json`, else `config.json` (or its `text_config`).
- Chat template precedence: the `chat_template` argument (string or file) > `chat_template.jinja`
  > `chat_template.json` > `tokenizer_config.json`; `additional_chat_templates/*.jinja` add
  named templates.
- Every unreadable or malformed file is a `CheckpointError` naming the file; a bad
  `chat_template` argument is an `InvalidRequestError` naming `chat_template`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from metrale.errors import CheckpointError, InvalidRequestError

logger = logging.getLogger(__name__)

_NAMED_SPECIALS: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "pad_token")
_EXTRA_SPECIALS_KEYS: tuple[str, ...] = ("additional_special_tokens", "extra_special_tokens")
DEFAULT_TEMPLATE_NAME = "default"


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def _token_content(value: Any, source: Path, key: str) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise CheckpointError(f"{source}: {key} must be a string or an object with 'content'")


def _int_ids(value: Any, source: Path) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise CheckpointError(f"{source}: eos_token_id must be an int or a list of ints")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise CheckpointError(f"{source}: eos_token_id must be an int or a list of ints")


def _templates_from_config_value(value: Any, source: Path) -> dict[str, str]:
    """`chat_template` as a string, or as a list of {"name", "template"} (or a name -> str map)."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE_NAME: value}
    if isinstance(value, list):
        templates: dict[str, str] = {}
        for entry in value:
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise CheckpointError(
                    f"{source}: chat_template list entries must be {{'name': str, 'template': str}}"
                )
            templates[entry["name"]] = entry["template"]
        return templates
    if isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values()):
        return {str(k): str(v) for k, v in value.items()}
    raise CheckpointError(f"{source}: chat_template must be a string or a list of named templates")


def _resolve_template_argument(chat_template: str) -> tuple[str, str]:
    """The template text and its origin for a `--chat-template` value (file path or template)."""
    candidate = Path(chat_template)
    try:
        is_file = "\n" not in chat_template and candidate.is_file()
    except (OSError, ValueError):  # a template is often too long, or too odd, to be a path
        is_file = False
    if is_file:
        try:
            return candidate.read_text(encoding="utf-8"), str(candidate)
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read chat template file {candidate}: {exc}") from exc
    if not any(c in chat_template for c in "{}\n"):
        raise InvalidRequestError(
            f"chat template {chat_template!r} is neither a readable file nor a Jinja template",
            param="chat_template",
        )
    return chat_template, "the chat_template argument"


def read_tokenizer_dir(
    path: str | Path, chat_template: str | None = None
) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """Load the tokenizer files of the checkpoint directory `path`.

    `chat_template` (a Jinja template or the path of a file holding one) replaces the
    checkpoint's default template.
    """
    root = Path(path)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(
            f"{tokenizer_file} not found: metrale needs a fast tokenizer (tokenizer.json) "
            "next to the model"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust library raises plain Exception subclasses
        raise CheckpointError(f"cannot load {tokenizer_file}: {exc}") from exc

    config_file = root / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_file.is_file():
        loaded = _read_json(config_file)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{config_file} must hold a JSON object")
        config = loaded

    specials: dict[str, str | None] = {
        key: _token_content(config.get(key), config_file, key) for key in _NAMED_SPECIALS
    }
    extra: list[str] = []
    for key in _EXTRA_SPECIALS_KEYS:
        extra.extend(_extra_specials(config.get(key), config_file, key))
    map_file = root / "special_tokens_map.json"
    if map_file.is_file():
        special_map = _read_json(map_file)
        if not isinstance(special_map, dict):
            raise CheckpointError(f"{map_file} must hold a JSON object")
        # HF reads the map only for configs without added_tokens_decoder, and lets it win.
        map_wins = "added_tokens_decoder" not in config
        for key in _NAMED_SPECIALS:
            value = _token_content(special_map.get(key), map_file, key)
            if value is not None and (map_wins or specials[key] is None):
                specials[key] = value
        for key in _EXTRA_SPECIALS_KEYS:
            extra.extend(_extra_specials(special_map.get(key), map_file, key))

    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise CheckpointError(f"{config_file}: added_tokens_decoder must be an object")
    _add_missing_added_tokens(backend, decoder, config_file)

    templates = _templates_from_config_value(config.get("chat_template"), config_file)
    origin = str(config_file)
    legacy_file = root / "chat_template.json"
    if legacy_file.is_file():
        legacy = _read_json(legacy_file)
        value = legacy.get("chat_template") if isinstance(legacy, dict) else None
        templates.update(_templates_from_config_value(value, legacy_file))
        origin = str(legacy_file)
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        templates[DEFAULT_TEMPLATE_NAME] = _read_text(jinja_file)
        origin = str(jinja_file)
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates.setdefault(file.stem, _read_text(file))
    if chat_template is not None:
        templates[DEFAULT_TEMPLATE_NAME], origin = _resolve_template_argument(chat_template)

    add_bos = config.get("add_bos_token")
    add_eos = config.get("add_eos_token")
    max_length = config.get("model_max_length")
    # HF writes 1e30 ("no limit") for tokenizers without a known length.
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length > 1 << 40:
        max_length = None

    return backend, dict(
        bos_token=specials["bos_token"],
        eos_token=specials["eos_token"],
        pad_token=specials["pad_token"],
        unk_token=specials["unk_token"],
        additional_special_tokens=extra,
        chat_templates=templates,
        chat_template_origin=origin,
        extra_eos_token_ids=_generation_eos_ids(root),
        add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        add_eos_token=add_eos if isinstance(add_eos, bool) else None,
        model_max_length=max_length,
        name_or_path=str(root),
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def _extra_specials(value: Any, source: Path, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, Mapping):  # v5: model-specific names -> token
        value = list(value.values())
    if not isinstance(value, list):
        raise CheckpointError(f"{source}: {key} must be a list of tokens")
    tokens = [_token_content(v, source, key) for v in value]
    return [t for t in tokens if t is not None]


def _add_missing_added_tokens(
    backend: tokenizers.Tokenizer, decoder: Mapping[str, Any], source: Path
) -> None:
    """Register `added_tokens_decoder` entries that tokenizer.json lacks, at their ids."""
    known = backend.get_added_tokens_decoder()
    entries: list[tuple[int, Any]] = []
    for key, entry in decoder.items():
        try:
            entries.append((int(key), entry))
        except ValueError as exc:
            raise CheckpointError(
                f"{source}: added_tokens_decoder key {key!r} is not an id"
            ) from exc
    for token_id, entry in sorted(entries, key=lambda e: e[0]):
        content = _token_content(entry, source, "added_tokens_decoder")
        if content is None or token_id in known:
            continue
        existing = backend.token_to_id(content)
        next_id = backend.get_vocab_size(with_added_tokens=True)
        if (existing is None and token_id != next_id) or existing not in (None, token_id):
            # HF adds it all the same (at the end); ids then differ from what the file says.
            logger.warning(
                "%s: added token %r is listed with id %d but will get id %d",
                source,
                content,
                token_id,
                next_id if existing is None else existing,
            )
        options = entry if isinstance(entry, Mapping) else {}
        special = bool(options.get("special", False))
        added = AddedToken(
            content,
            single_word=bool(options.get("single_word", False)),
            lstrip=bool(options.get("lstrip", False)),
            rstrip=bool(options.get("rstrip", False)),
            normalized=bool(options.get("normalized", not special)),
            special=special,
        )
        if special:
            backend.add_special_tokens([added])
        else:
            backend.add_tokens([added])


def _generation_eos_ids(root: Path) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        file = root / name
        if not file.is_file():
            continue
        data = _read_json(file)
        if not isinstance(data, dict):
            raise CheckpointError(f"{file} must hold a JSON object")
        if name == "config.json" and "eos_token_id" not in data:
            text_config = data.get("text_config")
            if isinstance(text_config, dict):
                data = text_config
        return _int_ids(data.get("eos_token_id"), file)
    return []
