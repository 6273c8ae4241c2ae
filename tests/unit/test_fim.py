"""Issue 17: the completions `suffix` is written in the model's own fill-in-the-middle layout
(Qwen, StarCoder, DeepSeek, CodeLlama tokens), and a model without FIM tokens refuses it by
name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from metrale.errors import Unsupported
from metrale.tokenizer.fim import FIM_LAYOUTS, fim_prompt
from metrale.tokenizer.tokenizer import Tokenizer
from tests.helpers.tiny_tokenizer import tokenizer_files


def with_tokens(tmp_path: Path, tokens: tuple[str, ...]) -> Tokenizer:
    out = tmp_path / "tok"
    shutil.copytree(tokenizer_files(), out)
    backend = Backend.from_file(str(out / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    backend.save(str(out / "tokenizer.json"))
    return Tokenizer.from_dir(out)


@pytest.mark.parametrize("layout", FIM_LAYOUTS[:3], ids=lambda v: v[0])
def test_fim_prompt_uses_the_vocabularys_layout(tmp_path: Path, layout: tuple) -> None:
    _, tokens, texts = layout
    tokenizer = with_tokens(tmp_path, tokens)
    prompt = fim_prompt(tokenizer, "def add(a, b):\n    ", "\n    return c")
    assert prompt == f"{texts[0]}def add(a, b):\n    {texts[1]}\n    return c{texts[2]}"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    for token in tokens:  # each marker is its one special token, not spelled out
        assert tokenizer.token_to_id(token) in ids


def test_no_fim_tokens_refuses_the_suffix() -> None:
    tokenizer = Tokenizer.from_dir(tokenizer_files())
    with pytest.raises(Unsupported) as err:
        fim_prompt(tokenizer, "a", "b")
    assert err.value.param == "suffix" and "fill-in-the-middle" in err.value.message
