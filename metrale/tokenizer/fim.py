"""Fill-in-the-middle prompts: the completions API's `suffix` for code models whose
tokenizer has FIM tokens.

Owner: tokenizer. `fim_prompt` writes a prefix and a suffix in the model's own FIM layout
(prefix-suffix-middle), chosen by the FIM tokens its vocabulary holds.

Invariants:
- The layouts known, checked in this order: Qwen2.5/Qwen3-Coder (`<|fim_prefix|>`,
  `<|fim_suffix|>`, `<|fim_middle|>`), StarCoder (`<fim_prefix>`, `<fim_suffix>`,
  `<fim_middle>`), DeepSeek-Coder (`<｜fim▁begin｜>`, `<｜fim▁hole｜>`, `<｜fim▁end｜>`),
  CodeLlama (`▁<PRE>`, `▁<SUF>`, `▁<MID>`). A layout is used only if all three of its tokens
  are in the vocabulary.
- A tokenizer with none of them gets an `Unsupported` error naming `suffix` and the layouts
  looked for: a suffix is never dropped or pasted as plain text.
"""

from __future__ import annotations

from metrale.errors import Unsupported
from metrale.tokenizer.tokenizer import Tokenizer

#: (name, before the prefix, between prefix and suffix, after the suffix), as token strings;
#: the CodeLlama entries are the vocabulary's pieces, written as the text that encodes them.
FIM_LAYOUTS: tuple[tuple[str, tuple[str, str, str], tuple[str, str, str]], ...] = (
    ("qwen", ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
     ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")),
    ("starcoder", ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
     ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")),
    ("deepseek", ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
     ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")),
    ("codellama", ("▁<PRE>", "▁<SUF>", "▁<MID>"), (" <PRE>", " <SUF>", " <MID>")),
)  # fmt: skip


def fim_layout(tokenizer: Tokenizer) -> tuple[str, str, str] | None:
    """The (prefix, suffix, middle) markers of the first layout the vocabulary holds."""
    for _, tokens, texts in FIM_LAYOUTS:
        if all(tokenizer.token_to_id(t) is not None for t in tokens):
            return texts
    return None


def fim_prompt(tokenizer: Tokenizer, prefix: str, suffix: str) -> str:
    """`prefix` and `suffix` as a prompt whose continuation is the middle between them."""
    layout = fim_layout(tokenizer)
    if layout is None:
        looked = ", ".join(name for name, _, _ in FIM_LAYOUTS)
        raise Unsupported(
            "'suffix' needs a model whose tokenizer has fill-in-the-middle tokens (layouts "
            f"known: {looked}); this model's has none",
            param="suffix",
        )
    before, between, after = layout
    return f"{before}{prefix}{between}{suffix}{after}"
