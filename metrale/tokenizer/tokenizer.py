"""The tokenizer of a checkpoint: `tokenizer.json` plus the Hub's side files, read without transformers.

Owner: tokenizer package (reading the checkpoint's files lives in `metrale.tokenizer.files`).
The engine, the server and the offline API build one `Tokenizer` per
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

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from metrale.errors import CheckpointError, InvalidRequestError
from metrale.tokenizer.chat_template import ChatTemplateRenderer
from metrale.tokenizer.files import DEFAULT_TEMPLATE_NAME, read_tokenizer_dir

logger = logging.getLogger(__name__)

_REQUEST_TEMPLATE_ORIGIN = "the request's chat_template"


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
        """Load the tokenizer files of the checkpoint directory `path` (`read_tokenizer_dir`).

        `chat_template` (a Jinja template or the path of a file holding one) replaces the
        checkpoint's default template.
        """
        backend, options = read_tokenizer_dir(path, chat_template)
        return cls(backend, **options)

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
