"""Tokenizer loading, encode/decode and chat-template parity with Hugging Face, and bad inputs.

Owner: tokenizer package.

Invariants checked: `metrale.tokenizer.Tokenizer` agrees with `transformers.AutoTokenizer` on the
tiny tokenizer in both on-disk layouts; special tokens and eos ids come from the files they are
documented to come from; a missing file or template gives an error that names it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from metrale.errors import CheckpointError, InvalidRequestError
from metrale.tokenizer import Tokenizer
from tests.helpers.tiny_tokenizer import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    copy_tokenizer_into,
    tokenizer_files,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "",
    "def f(x):\n    return x + 1\n",
    "Hello, world!",
    "héllo wörld — naïve café",
    "e\u0301 combining accent",  # NFC turns e + U+0301 into é
    "😀 emoji 👩‍👩‍👧 family 🇫🇷 flag",
    "日本語のテキストと中文",
    "   \t\n\n  whitespace runs   ",
    "<|im_start|>user\nhi<|im_end|>",
    "</s> in the middle <s> and <pad>",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2? 😀"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "日本語"},
    ],
]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["inline", "template_file"])
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    return tokenizer_files(template_file=request.param == "template_file")


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    write_json(path, config)


# --------------------------------------------------------------------------- HF parity


def test_layouts_on_disk() -> None:
    inline = tokenizer_files()
    separate = tokenizer_files(template_file=True)
    assert not (inline / "chat_template.jinja").exists()
    assert json.loads((inline / "tokenizer_config.json").read_text())["chat_template"] == (
        CHATML_TEMPLATE
    )
    assert "chat_template" not in json.loads((separate / "tokenizer_config.json").read_text())
    assert (separate / "chat_template.jinja").read_text() == CHATML_TEMPLATE
    # One interpreter, one vocabulary: the layouts share tokenizer.json byte for byte.
    assert (inline / "tokenizer.json").read_bytes() == (separate / "tokenizer.json").read_bytes()


def test_special_tokens_match_hf(tok: Tokenizer, hf_tokenizer: Any) -> None:
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == frozenset({2})
    assert tok.vocab_size == len(hf_tokenizer) == 512
    assert set(tok.all_special_ids) == set(hf_tokenizer.all_special_ids) == set(range(6))
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.eos_token_id == hf_tokenizer.eos_token_id
    assert tok.pad_token_id == hf_tokenizer.pad_token_id
    assert tok.chat_template == CHATML_TEMPLATE == hf_tokenizer.chat_template
    assert tok.model_max_length == 512


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(tok: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=add_special)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # the post-processor adds <s>
    assert tok.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.encode_batch(TEXTS, add_special_tokens=False) == [
        tok.encode(t, add_special_tokens=False) for t in TEXTS
    ]


def test_id_token_lookup(tok: Tokenizer) -> None:
    assert tok.id_to_token(4) == "<|im_start|>"
    assert tok.token_to_id("<|im_end|>") == 5
    assert tok.token_to_id("definitely not a token") is None
    assert tok.id_to_token(10**6) is None
    # Ids past the vocabulary (padded embedding rows) decode to nothing instead of failing.
    assert tok.decode([*tok.encode("ok", add_special_tokens=False), 10**6]) == "ok"


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "several"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(
    tok: Tokenizer,
    hf_tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert rendered == expected
    hf_ids = hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys"):
        hf_ids = hf_ids["input_ids"]
    assert tok.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == hf_ids


def test_chatml_rendering_is_the_expected_text(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 4 and ids.count(4) == 2 and ids.count(5) == 1  # specials, not their text
    assert tok.bos_token_id not in ids  # the template decides, not the post-processor


RICH_TEMPLATE = """{{ bos_token }}
{%- if tools %}TOOLS={{ tools | tojson(indent=2, sort_keys=True) }}
{% endif %}
{%- for m in messages %}
  {%- if m['role'] == 'stop' %}{% break %}{% endif %}
  {%- if m['role'] == 'skip' %}{% continue %}{% endif %}
  {%- generation %}[{{ m['role'] }}|{{ m.get('content', 'NONE') }}|{{ m | tojson }}]{% endgeneration %}
{% endfor %}
{%- if add_generation_prompt %}<gen think={{ enable_thinking | default(true) }}>{% endif %}"""


def test_rich_template_matches_hf(tok: Tokenizer, hf_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": 'Use <tools> & be "nice" — ünïcode'},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
        {"role": "user", "content": "after"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "never"},
    ]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"b": 1, "a": 2}}}]
    ours = tok.apply_chat_template(
        messages, tools=tools, chat_template=RICH_TEMPLATE, enable_thinking=False
    )
    theirs = hf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=RICH_TEMPLATE,
        enable_thinking=False,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert ours == theirs
    assert ours.startswith("<s>TOOLS=[\n  {")
    assert '"a": 2,\n' in ours  # indent and sort_keys reach json.dumps
    assert '<tools> & be \\"nice\\" — ünïcode' in ours  # no HTML escaping, no \\u escapes
    assert "hidden" not in ours and "never" not in ours  # continue / break work
    assert "|NONE|" in ours  # content: None is dropped, as HF does
    assert ours.endswith("<gen think=False>")


def test_template_helpers(tok: Tokenizer) -> None:
    template = "{{ strftime_now('%Y') }}|{{ eos_token }}|{{ custom }}|{{ additional_special_tokens | length }}"
    rendered = tok.apply_chat_template(HI, chat_template=template, custom="x")
    year, eos, custom, extra = rendered.split("|")
    assert len(year) == 4 and year.isdigit()
    assert (eos, custom, extra) == ("</s>", "x", "2")


def test_template_raise_exception_is_a_request_error(tok: Tokenizer) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert (
        tok.apply_chat_template([{"role": "user", "content": "a"}], chat_template=template) == "ok"
    )
    with pytest.raises(InvalidRequestError, match="first must be user") as info:
        tok.apply_chat_template([{"role": "system", "content": "a"}], chat_template=template)
    assert info.value.param == "messages"


def test_bad_messages_are_request_errors(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(["not a dict"])  # type: ignore[list-item]
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="at least one message"):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequestError, match="cannot render"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ 1 / 0 }}")


def test_unsafe_template_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="unsafe"):
        tok.apply_chat_template(HI, chat_template="{{ messages.__class__.__mro__ }}")


# --------------------------------------------------------------------------- checkpoint variants


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [2, 5], "bos_token_id": 1})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({2, 5})

    write_json(tmp_path / "generation_config.json", {"eos_token_id": 5})
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == frozenset({2, 5})

    # Without a generation config, the model config's eos ids count (what HF generate uses).
    (tmp_path / "generation_config.json").unlink()
    write_json(tmp_path / "config.json", {"eos_token_id": [4]})
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == frozenset({2, 4})

    write_json(tmp_path / "generation_config.json", {"eos_token_id": "two"})
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        Tokenizer.from_dir(tmp_path)


def test_added_token_dicts_and_special_tokens_map(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    edit_config(
        tmp_path,
        bos_token={"content": "<s>", "lstrip": False, "normalized": False, "special": True},
        eos_token=None,
        pad_token=None,
        added_tokens_decoder=None,
    )
    write_json(
        tmp_path / "special_tokens_map.json",
        {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<pad>"},
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 5
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == 0


def test_added_tokens_decoder_extends_vocab_like_hf(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["512"] = {"content": "<tool>", "special": True}
    config["added_tokens_decoder"]["513"] = {"content": "plainword", "special": False}
    write_json(tmp_path / "tokenizer_config.json", config)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == 514
    assert tok.token_to_id("<tool>") == 512
    ids = tok.encode("a<tool>b plainword", add_special_tokens=False)
    assert 512 in ids and 513 in ids
    assert 512 in tok.all_special_ids and 513 not in tok.all_special_ids
    assert tok.decode(ids) == "ab plainword"  # special skipped, plain kept
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ids == hf.encode("a<tool>b plainword", add_special_tokens=False)


def test_add_bos_and_eos_flags_win_over_post_processor(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    plain = Tokenizer.from_dir(tmp_path).encode("hi", add_special_tokens=False)
    edit_config(tmp_path, add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hi") == [*plain, 2]
    assert tok.encode("hi", add_special_tokens=False) == plain
    edit_config(tmp_path, add_bos_token=True, add_eos_token=False)
    assert Tokenizer.from_dir(tmp_path).encode("hi") == [1, *plain]


def test_named_chat_templates(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    edit_config(
        tmp_path,
        chat_template=[
            {"name": "default", "template": "D{{ messages | length }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
        ],
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == "D{{ messages | length }}"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    assert tok.apply_chat_template(HI, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.apply_chat_template(HI, chat_template="tool_use", tools=[]) == "T0"

    edit_config(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}])
    with pytest.raises(InvalidRequestError, match="--chat-template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(HI)


def test_template_precedence(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)  # inline ChatML
    write_json(tmp_path / "chat_template.json", {"chat_template": "LEGACY"})
    assert Tokenizer.from_dir(tmp_path).chat_template == "LEGACY"
    (tmp_path / "chat_template.jinja").write_text("JINJA{{ 1 }}", encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(HI) == "JINJA1"

    override = tmp_path / "override.jinja"
    override.write_text("FILE", encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path, chat_template=str(override)).chat_template == "FILE"
    literal = Tokenizer.from_dir(tmp_path, chat_template="{{ 'LITERAL' }}")
    assert literal.apply_chat_template(HI) == "LITERAL"
    with pytest.raises(InvalidRequestError) as info:
        Tokenizer.from_dir(tmp_path, chat_template=str(tmp_path / "missing.jinja"))
    assert info.value.param == "chat_template"
    assert "missing.jinja" in info.value.message


# --------------------------------------------------------------------------- errors


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in info.value.message


def test_corrupt_files_name_the_file(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.rmtree(tmp_path)
    copy_tokenizer_into(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}', encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_no_chat_template_is_a_clear_request_error(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    edit_config(tmp_path, chat_template=None)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    assert tok.encode("still encodes") == Tokenizer.from_dir(tokenizer_files()).encode(
        "still encodes"
    )
    with pytest.raises(InvalidRequestError) as info:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert "no chat template" in info.value.message
    assert "--chat-template" in info.value.message
    assert info.value.status_code == 400


def test_template_syntax_errors(tmp_path: Path) -> None:
    copy_tokenizer_into(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}", encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja"):
        tok.apply_chat_template(HI)
    # The same mistake in a template sent with a request is the client's error.
    good = Tokenizer.from_dir(tokenizer_files())
    with pytest.raises(InvalidRequestError) as info:
        good.apply_chat_template(HI, chat_template="{% if %}")
    assert info.value.param == "chat_template"


def test_non_string_text_is_a_request_error(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        tok.encode(123)  # type: ignore[arg-type]
