"""The tokenizer of a checkpoint: `tokenizer.json` plus the Hub's side files, read without transformers.

Owner: tokenizer package. The engine, the server and the offline API build one `Tokenizer` per
model with `Tokenizer.from_dir` and share it between threads.

Invariants:
- `encode`, `decode` and `apply_chat_template` give what Hugging Face `AutoTokenizer` gives on
  the same directory (fast tokenizer backend; `clean_up_tokenization_spaces` is ignored, as
  transformers 5 ignores it for BPE and as streaming detokenization must).
- Special tokens come from `tokenizer_config.json` (strings or AddedToken dicts), completed by
  `special_tokens_map.json`; any of them missing from the backend's added vocabulary is added
  as special, as HF does, so ids agree with HF.
- `eos_token_ids` holds the tokenizer's eos id plus every eos id in `generation_config.json`
  (or `config.json` when there is no generation config); `eos_token_id` stays the tokenizer's.
- Chat template precedence: the `chat_template` argument (string or file) > `chat_template.jinja`
  > `chat_template.json` > `tokenizer_config.json`. Named templates keep their names; "default"
  is used unless tools are given and a "tool_use" template exists.
- An explicit `add_bos_token` / `add_eos_token` in `tokenizer_config.json` wins over what the
  `tokenizer.json` post-processor does (transformers 4 semantics); without them the
  post-processor decides.
- The instance is immutable after construction apart from its compiled-template cache.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from metrale.errors import CheckpointError, InvalidRequestError
from metrale.tokenizer.chat_template import ChatTemplateRenderer

logger = logging.getLogger(__name__)

_NAMED_SPECIALS: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "pad_token")
_EXTRA_SPECIALS_KEYS: tuple[str, ...] = ("additional_special_tokens", "extra_special_tokens")
DEFAULT_TEMPLATE_NAME = "default"
_REQUEST_TEMPLATE_ORIGIN = "the request's chat_template"


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


class Tokenizer:
    """A checkpoint's tokenizer: encoding, decoding, special tokens and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        additional_special_tokens: Sequence[str] = (),
        chat_templates: Mapping[str, str] | None = None,
        chat_template_origin: str = "the tokenizer",
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        model_max_length: int | None = None,
        name_or_path: str | None = None,
    ) -> None:
        """Wrap `backend` (which this instance takes over: it may add special tokens to it)."""
        self._backend = backend
        self._special_tokens: dict[str, str] = {
            name: token
            for name, token in (
                ("bos_token", bos_token),
                ("eos_token", eos_token),
                ("unk_token", unk_token),
                ("pad_token", pad_token),
            )
            if token is not None
        }
        self._additional_special_tokens: tuple[str, ...] = tuple(
            dict.fromkeys(additional_special_tokens)
        )
        self._register_special_tokens()
        self._apply_bos_eos_flags(add_bos_token, add_eos_token)

        self._bos_token_id = self._id_of(bos_token)
        self._eos_token_id = self._id_of(eos_token)
        self._pad_token_id = self._id_of(pad_token)
        self._unk_token_id = self._id_of(unk_token)
        eos_ids = {i for i in extra_eos_token_ids}
        if self._eos_token_id is not None:
            eos_ids.add(self._eos_token_id)
        self._eos_token_ids = frozenset(eos_ids)

        special_ids: dict[int, None] = {}
        for token in (*self._special_tokens.values(), *self._additional_special_tokens):
            token_id = self._backend.token_to_id(token)
            if token_id is not None:
                special_ids[token_id] = None
        for token_id, added in sorted(self._backend.get_added_tokens_decoder().items()):
            if added.special:
                special_ids[token_id] = None
        self._all_special_ids = tuple(special_ids)

        self._chat_templates: dict[str, str] = dict(chat_templates or {})
        self._chat_template_origin = chat_template_origin
        self._renderer = ChatTemplateRenderer()
        self._model_max_length = model_max_length
        self.name_or_path = name_or_path

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
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
            extra.extend(cls._extra_specials(config.get(key), config_file, key))
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
                extra.extend(cls._extra_specials(special_map.get(key), map_file, key))

        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise CheckpointError(f"{config_file}: added_tokens_decoder must be an object")
        cls._add_missing_added_tokens(backend, decoder, config_file)

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
            templates[DEFAULT_TEMPLATE_NAME] = cls._read_text(jinja_file)
            origin = str(jinja_file)
        extra_dir = root / "additional_chat_templates"
        if extra_dir.is_dir():
            for file in sorted(extra_dir.glob("*.jinja")):
                templates.setdefault(file.stem, cls._read_text(file))
        if chat_template is not None:
            templates[DEFAULT_TEMPLATE_NAME], origin = _resolve_template_argument(chat_template)

        add_bos = config.get("add_bos_token")
        add_eos = config.get("add_eos_token")
        max_length = config.get("model_max_length")
        # HF writes 1e30 ("no limit") for tokenizers without a known length.
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length > 1 << 40:
            max_length = None

        return cls(
            backend,
            bos_token=specials["bos_token"],
            eos_token=specials["eos_token"],
            pad_token=specials["pad_token"],
            unk_token=specials["unk_token"],
            additional_special_tokens=extra,
            chat_templates=templates,
            chat_template_origin=origin,
            extra_eos_token_ids=cls._generation_eos_ids(root),
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            add_eos_token=add_eos if isinstance(add_eos, bool) else None,
            model_max_length=max_length,
            name_or_path=str(root),
        )

    @staticmethod
    def _read_text(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc

    @staticmethod
    def _extra_specials(value: Any, source: Path, key: str) -> list[str]:
        if value is None:
            return []
        if isinstance(value, Mapping):  # v5: model-specific names -> token
            value = list(value.values())
        if not isinstance(value, list):
            raise CheckpointError(f"{source}: {key} must be a list of tokens")
        tokens = [_token_content(v, source, key) for v in value]
        return [t for t in tokens if t is not None]

    @staticmethod
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

    @staticmethod
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

    def _register_special_tokens(self) -> None:
        """Make every named and additional special token a special added token of the backend."""
        added = {t.content: t for t in self._backend.get_added_tokens_decoder().values()}
        missing: list[AddedToken] = []
        for token in (*self._special_tokens.values(), *self._additional_special_tokens):
            current = added.get(token)
            if current is None or not current.special:
                missing.append(AddedToken(token, special=True, normalized=False))
        if missing:
            logger.debug("registering special tokens missing from tokenizer.json: %s", missing)
            self._backend.add_special_tokens(missing)

    def _apply_bos_eos_flags(self, add_bos: bool | None, add_eos: bool | None) -> None:
        if add_bos is None and add_eos is None:
            return
        probe = self._backend.encode("", add_special_tokens=True).ids
        bos_id = self._id_of(self._special_tokens.get("bos_token"))
        eos_id = self._id_of(self._special_tokens.get("eos_token"))
        adds_bos = bool(probe) and bos_id is not None and probe[0] == bos_id
        adds_eos = bool(probe) and eos_id is not None and probe[-1] == eos_id
        want_bos = adds_bos if add_bos is None else add_bos and bos_id is not None
        want_eos = adds_eos if add_eos is None else add_eos and eos_id is not None
        if (want_bos, want_eos) == (adds_bos, adds_eos):
            return
        bos = self._special_tokens.get("bos_token")
        eos = self._special_tokens.get("eos_token")
        single = " ".join(
            [*([f"{bos}:0"] if want_bos else []), "$A:0", *([f"{eos}:0"] if want_eos else [])]
        )
        pair = " ".join(
            [
                single,
                *([f"{bos}:1"] if want_bos else []),
                "$B:1",
                *([f"{eos}:1"] if want_eos else []),
            ]
        )
        special_tokens: list[tuple[str, int]] = []
        if want_bos and bos is not None and bos_id is not None:
            special_tokens.append((bos, bos_id))
        if want_eos and eos is not None and eos_id is not None:
            special_tokens.append((eos, eos_id))
        logger.info(
            "tokenizer_config.json sets add_bos_token=%s add_eos_token=%s; the tokenizer.json "
            "post-processor disagrees, so the config wins",
            add_bos,
            add_eos,
        )
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special_tokens
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (HF's `len(tokenizer)`)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own eos id (None if it has no eos token)."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the tokenizer's eos plus the generation config's."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def unk_token_id(self) -> int | None:
        return self._unk_token_id

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids of the named, additional and added special tokens, without duplicates."""
        return self._all_special_ids

    @property
    def model_max_length(self) -> int | None:
        return self._model_max_length

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None if the model has none."""
        return self._chat_templates.get(DEFAULT_TEMPLATE_NAME)

    @property
    def chat_template_names(self) -> tuple[str, ...]:
        return tuple(self._chat_templates)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"text to tokenize must be a string, got {type(text).__name__}", param="prompt"
            )
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        for text in texts:
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"texts to tokenize must be strings, got {type(text).__name__}", param="prompt"
                )
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary are dropped, invalid UTF-8 becomes U+FFFD."""
        if not isinstance(ids, list):
            ids = list(ids)
        return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` with the model's chat template (or the named/inline `chat_template`).

        `extra` keyword arguments become template variables (e.g. `enable_thinking`,
        `documents`); they override the special-token variables.
        """
        source, origin = self._select_template(chat_template, tools)
        variables: dict[str, Any] = dict(self._special_tokens)
        variables["additional_special_tokens"] = list(self._additional_special_tokens)
        variables.update(extra)
        try:
            return self._renderer.render(
                source,
                origin,
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                variables=variables,
            )
        except CheckpointError as exc:
            if origin != _REQUEST_TEMPLATE_ORIGIN:
                raise
            # A template sent with the request is the client's to fix, not the checkpoint's.
            raise InvalidRequestError(exc.message, param="chat_template") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation (the template writes any bos itself)."""
        rendered = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )
        return self.encode(rendered, add_special_tokens=False)

    def _select_template(
        self, chat_template: str | None, tools: list[dict[str, Any]] | None
    ) -> tuple[str, str]:
        if chat_template is not None:
            if chat_template in self._chat_templates:
                return self._chat_templates[chat_template], f"template {chat_template!r}"
            return chat_template, _REQUEST_TEMPLATE_ORIGIN
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"], f"{self._chat_template_origin} (tool_use)"
        if DEFAULT_TEMPLATE_NAME in self._chat_templates:
            return self._chat_templates[DEFAULT_TEMPLATE_NAME], self._chat_template_origin
        if self._chat_templates:
            names = ", ".join(sorted(self._chat_templates))
            raise InvalidRequestError(
                f"the model has several chat templates ({names}) and none is named 'default'; "
                "start the server with --chat-template to choose one",
                param="messages",
            )
        raise InvalidRequestError(
            f"the model {self.name_or_path or ''} has no chat template, so chat messages cannot "
            "be turned into a prompt; --chat-template can supply one (a Jinja file or string)",
            param="messages",
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)})"
        )
