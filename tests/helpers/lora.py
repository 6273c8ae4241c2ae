"""Tiny random PEFT LoRA adapters for the tiny checkpoints, written by peft itself.

Owner: tests. `build_adapter(base, spec)` writes a real adapter directory
(`adapter_config.json` + `adapter_model.safetensors`) with `peft.get_peft_model(...)
.save_pretrained(...)`, so the loader under test reads exactly what users' adapters hold.

Invariants:
- Deterministic: the same base and spec always get the same weights (seeded init; lora_B is
  drawn at random too, so the delta is never the zero peft starts from).
- Built once per process per (base, spec), into a temporary directory removed at exit.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(tempfile.mkdtemp(prefix="metrale-lora-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    targets: tuple[str, ...]
    rank: int
    alpha: float
    rslora: bool = False
    seed: int = 0
    #: Scale of the random lora_B entries (large enough to change greedy tokens).
    b_std: float = 0.2


#: Two adapters that differ in targets, ranks and scaling.
ADAPTER_A = AdapterSpec("sql", ("q_proj", "v_proj", "down_proj"), rank=8, alpha=16, seed=1)
ADAPTER_B = AdapterSpec(
    "poet",
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    rank=4, alpha=8, rslora=True, seed=2,
)  # fmt: skip


def peft_model(base: Path, spec: AdapterSpec):
    """The base checkpoint with `spec`'s adapter, as peft builds it (float32, eval)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    cfg = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
        use_rslora=spec.rslora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(spec.seed)
    peft = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * spec.b_std)
    return peft.eval()


@functools.cache
def build_adapter(base: Path, spec: AdapterSpec) -> Path:
    out = _ROOT / f"{base.name}-{spec.name}"
    peft_model(base, spec).save_pretrained(str(out))
    return out
