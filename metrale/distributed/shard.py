"""What one tensor-parallel rank holds of a model, and how its module is cut: the rank's
shapes (`ShardPlan.local_config`), the slice of each checkpoint tensor it reads, the
vocab-parallel embedding and the all-reduce after each row-parallel half.

Owner: distributed. The architectures stay unaware of tensor parallelism: a rank builds the
ordinary module from its local config (a quarter of the heads at TP=4, a quarter of the MLP
and expert width, a quarter of the vocabulary, padded), and `shard_module` then swaps in the
vocab-parallel embedding and hooks one all-reduce onto each attention block and each MLP.

Invariants:
- Column-parallel (rows of the output): q/k/v (by head; k/v by KV head, each KV head
  replicated on `world_size / num_kv_heads` ranks when the ranks outnumber them), gate/up of
  every dense MLP and expert. Row-parallel (columns of the input): o_proj, down_proj / w2;
  their outputs are partial sums, all-reduced once per block half; their biases are read on
  rank 0 only (zeros elsewhere) so the sum adds them once.
- Vocabulary: rank r holds rows `[r * V_local, (r + 1) * V_local)` of the embedding and LM
  head (`V_local = ceil(V / world_size)`, the last rank padded with zero rows); the embedding
  zeroes ids outside its range, then all-reduces; logits are all-gathered and cut back to V.
- Norms, routers and rotary tables are replicated. Each rank reads only its slices of the
  checkpoint (`safe_open(...).get_slice`).
- Expert parallel (`expert_parallel`): rank r holds whole experts `[r * E_local, ...)`, every
  rank routes all tokens with the full router, computes its experts' share (others' weights
  zeroed) and the MLP's all-reduce adds the shares.
- A shape that does not divide (heads, KV heads, widths, experts) is refused at start-up
  with an error naming the field; so are architectures and features not built for it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from metrale.distributed.group import TensorParallel
from metrale.errors import CheckpointError, InvalidRequestError
from metrale.layers.moe import SparseMoeBlock
from metrale.model_config import ModelConfig

#: Architectures whose module `shard_module` knows how to cut.
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
    }
)
MOE_ARCHITECTURES = frozenset({"Qwen3MoeForCausalLM", "MixtralForCausalLM"})

_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
_COLUMN_PARTS = ("gate_proj", "up_proj", "w1", "w3")
_ROW_PARTS = ("down_proj", "w2")


def _param(field: str) -> str:
    return "tensor_parallel_size" if field != "expert_parallel" else "enable_expert_parallel"


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world_size`: which heads, widths, vocabulary rows and experts it holds."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int = 0
    expert_parallel: bool = False

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, rank: int, world_size: int, expert_parallel: bool = False
    ) -> ShardPlan:
        """The plan, after checking that `cfg` divides over `world_size` ranks."""
        n = world_size
        arch = cfg.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise InvalidRequestError(
                f"tensor_parallel_size {n}: {arch} is not built for tensor parallelism "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
                param="tensor_parallel_size",
            )
        if expert_parallel and arch not in MOE_ARCHITECTURES:
            raise InvalidRequestError(
                f"enable_expert_parallel: {arch} has no experts", param="enable_expert_parallel"
            )

        def need(value: int, what: str, field: str = "tensor_parallel_size") -> None:
            if value % n:
                raise InvalidRequestError(
                    f"tensor_parallel_size {n} does not divide the checkpoint's {what} ({value})",
                    param=_param(field),
                )

        need(cfg.num_attention_heads, "num_attention_heads")
        kv = cfg.num_key_value_heads
        if kv % n and n % kv:
            raise InvalidRequestError(
                f"tensor_parallel_size {n}: num_key_value_heads {kv} neither divides it nor is "
                "divided by it (each rank needs whole KV heads)",
                param="tensor_parallel_size",
            )
        need(cfg.intermediate_size, "intermediate_size")
        experts = 0
        if arch in MOE_ARCHITECTURES:
            experts = int(cfg.raw.get("num_experts") or cfg.raw.get("num_local_experts") or 0)
            if expert_parallel:
                need(experts, "expert count", "expert_parallel")
            elif arch == "Qwen3MoeForCausalLM":
                need(int(cfg.raw.get("moe_intermediate_size") or 0), "moe_intermediate_size")
        return cls(
            rank, n, cfg.num_attention_heads, kv, cfg.head_dim, cfg.vocab_size, experts,
            expert_parallel,
        )  # fmt: skip

    # ------------------------------------------------------------------ shapes

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds (replicated KV heads: the one its q heads read)."""
        if self.num_kv_heads >= self.world_size:
            return self.rank * self.local_kv_heads
        return self.rank // (self.world_size // self.num_kv_heads)

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank builds its module from: its heads, widths and vocabulary."""
        n = self.world_size
        raw = dict(cfg.raw)
        intermediate = cfg.intermediate_size // n
        if self.expert_parallel:
            experts = self.local_experts
            raw["num_experts" if "num_experts" in raw else "num_local_experts"] = experts
            if cfg.architecture == "MixtralForCausalLM":
                intermediate = cfg.intermediate_size  # Mixtral's experts share this width
        elif raw.get("moe_intermediate_size"):
            raw["moe_intermediate_size"] = int(raw["moe_intermediate_size"]) // n
        return dataclasses.replace(
            cfg,
            num_attention_heads=self.local_heads,
            num_key_value_heads=self.local_kv_heads,
            intermediate_size=intermediate,
            vocab_size=self.local_vocab,
            raw=raw,
        )

    # ------------------------------------------------------------------ slices

    def _even(self, size: int, name: str) -> tuple[int, int]:
        if size % self.world_size:
            raise CheckpointError(
                f"tensor '{name}': dimension {size} does not split over {self.world_size} ranks"
            )
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def read(self, name: str, handle: Any) -> tuple[str, torch.Tensor] | None:
        """`(name, this rank's part)` of checkpoint tensor `name` from `handle` (an open
        `safe_open`), reading only that part; expert parallel renumbers a per-expert name to
        the local expert; None: another rank's expert, not read."""
        local_name = self.expert_name(name)
        if local_name is None:
            return None
        part = handle.get_slice(name)
        sliced = self._slice(name, part)
        return local_name, sliced if sliced is not None else handle.get_tensor(name)

    def _slice(self, name: str, part: Any) -> torch.Tensor | None:
        """This rank's part of `name` through its safetensors slice; None: replicated."""
        shape = list(part.get_shape())
        if re.search(r"(^|\.)(embed_tokens|lm_head)\.weight$", name):
            start = min(self.vocab_start, shape[0])
            end = min(start + self.local_vocab, shape[0])
            rows = part[start:end]
            pad = self.local_vocab - rows.shape[0]
            return F.pad(rows, (0, 0, 0, pad)) if pad else rows
        expert = _EXPERT.search(name)
        if expert is not None:
            if self.expert_parallel:
                return None  # whole experts; `shard_module`'s loader mapping renumbers them
            proj = expert.group(2)
            if proj in _COLUMN_PARTS:
                a, b = self._even(shape[0], name)
                return part[a:b]
            if proj in _ROW_PARTS:
                a, b = self._even(shape[1], name)
                return part[:, a:b]
            return None
        if name.endswith(".experts.gate_up_proj"):  # fused [E, 2I, H]
            if self.expert_parallel:
                a, b = self._experts_range(shape[0], name)
                return part[a:b]
            half = shape[1] // 2
            a, b = self._even(half, name)
            return torch.cat([part[:, a:b], part[:, half + a : half + b]], dim=1)
        if name.endswith(".experts.down_proj"):  # fused [E, H, I]
            if self.expert_parallel:
                a, b = self._experts_range(shape[0], name)
                return part[a:b]
            a, b = self._even(shape[2], name)
            return part[:, :, a:b]
        if re.search(r"\.self_attn\.q_proj\.(weight|bias)$", name):
            a, b = self._even(shape[0], name)
            return part[a:b]
        if re.search(r"\.self_attn\.[kv]_proj\.(weight|bias)$", name):
            d = shape[0] // self.num_kv_heads
            start = self.kv_head_start * d
            return part[start : start + self.local_kv_heads * d]
        if re.search(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$", name):
            a, b = self._even(shape[1], name)
            return part[:, a:b]
        if re.search(r"\.(self_attn\.o_proj|mlp\.down_proj)\.bias$", name):
            return part[:] if self.rank == 0 else torch.zeros(shape)
        if re.search(r"\.mlp\.(gate_proj|up_proj)\.(weight|bias)$", name):
            a, b = self._even(shape[0], name)
            return part[a:b]
        return None

    def _experts_range(self, count: int, name: str) -> tuple[int, int]:
        return self._even(count, name)

    def expert_name(self, name: str) -> str | None:
        """Expert parallel: a per-expert checkpoint name renumbered to this rank's local
        expert index; None for another rank's expert (not read). Other names unchanged."""
        expert = _EXPERT.search(name)
        if not self.expert_parallel or expert is None:
            return name
        local = int(expert.group(1)) - self.rank * self.local_experts
        if not 0 <= local < self.local_experts:
            return None
        start, end = expert.span(1)
        return name[:start] + str(local) + name[end:]


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; a lookup zeroes the ids it does not hold and sums
    the ranks' rows (one all-reduce)."""

    def __init__(self, plan: ShardPlan, hidden: int, tp: TensorParallel) -> None:
        super().__init__(plan.local_vocab, hidden)
        self.vocab_start = plan.vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(rows)


class ExpertParallelMoe:
    """Expert parallel: the full router picks each token's experts; this rank computes the
    share of its own experts (`[start, start + E_local)`), the others' weights set to zero;
    the MLP's all-reduce adds the ranks' shares."""

    def __init__(self, block: SparseMoeBlock, plan: ShardPlan) -> None:
        self.block = block
        self.start = plan.rank * plan.local_experts
        self.count = plan.local_experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block
        spec = block.gate.spec
        ids, weights = block.gate(x)
        local = ids - self.start
        mine = (local >= 0) & (local < self.count)
        weights = weights.masked_fill(~mine, 0.0)
        local = local.masked_fill(~mine, 0)
        w_in, w_out = block.experts.weights()
        return block.experts.ops.moe_experts(
            x, w_in, w_out, local, weights, spec.gated, spec.activation
        )


def shard_module(module: nn.Module, plan: ShardPlan, tp: TensorParallel) -> None:
    """Cut a module built from `plan.local_config`: the vocab-parallel embedding in place of
    the embedding, one all-reduce after each attention block and each MLP, and (expert
    parallel) each sparse block routed over all experts."""
    stack = module.model  # type: ignore[attr-defined]
    old = stack.embed_tokens
    embed = VocabParallelEmbedding(plan, old.embedding_dim, tp)
    embed.to(device=old.weight.device, dtype=old.weight.dtype)
    stack.embed_tokens = embed

    def reduce(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(output)

    for layer in stack.layers:
        layer.self_attn.register_forward_hook(reduce)
        if plan.expert_parallel and isinstance(layer.mlp, SparseMoeBlock):
            router = layer.mlp.gate  # routes over every expert, not only this rank's
            old_weight = router.weight
            router.weight = nn.Parameter(
                old_weight.new_empty(plan.num_experts, old_weight.shape[1]), requires_grad=False
            )
            layer.mlp.forward = ExpertParallelMoe(layer.mlp, plan)  # type: ignore[method-assign]
        layer.mlp.register_forward_hook(reduce)
