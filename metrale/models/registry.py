"""Architecture registry: the `architectures` name in config.json -> the module class.

Owner: models. The only place that knows which classes exist.

Invariants:
- An unknown architecture is a `CheckpointError` naming it and listing what is supported.
"""

from __future__ import annotations

from metrale.errors import CheckpointError
from metrale.models.bamba import BambaForCausalLM
from metrale.models.llama import LlamaForCausalLM
from metrale.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from metrale.models.nemotron_h import NemotronHForCausalLM
from metrale.models.qwen3_next import Qwen3NextForCausalLM
from metrale.models.qwen_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
}

#: model_type -> architecture, for configs without an `architectures` list.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "bamba": "BambaForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


def resolve_architecture(
    architectures: list[str] | None, model_type: str | None
) -> tuple[str, type]:
    names = list(architectures or [])
    if not names and model_type in MODEL_TYPES:
        names = [MODEL_TYPES[model_type]]
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    shown = ", ".join(names) if names else f"model_type '{model_type}'"
    raise CheckpointError(
        f"unsupported architecture {shown}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )
