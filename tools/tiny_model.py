"""A compact Qwen3 with one multi-token-prediction (MTP) layer, for training `metrale-tiny-code`.

Owns the training-side model of issue 6 and its checkpoint format. It is independent of the
metrale engine (which must serve the same weights), and mirrors Hugging Face transformers'
Qwen3 numerics exactly: RMSNorm in float32 then cast back and scaled by the weight (eps 1e-6),
q/k RMSNorm over head_dim applied per head before RoPE, rotate-half RoPE with
inv_freq = 1 / theta^(arange(0, head_dim, 2) / head_dim) computed in float32, GQA by
repeating each KV head for consecutive query heads, SwiGLU MLP, pre-norm residual blocks,
final norm, LM head tied to the input embedding.

MTP layout (Qwen3-Next / DeepSeek-V3 style, names under `mtp.`): for position i,
    h_i   = last hidden state of the main model at i, BEFORE `model.norm`
    e_i   = embed_tokens(token[i+1])                       (shared embedding)
    z_i   = mtp.fc(concat(mtp.pre_fc_norm_embedding(e_i), mtp.pre_fc_norm_hidden(h_i)))
    z     = mtp.layers.0(z)      (a full Qwen3 decoder layer, causal over positions, RoPE position i)
    logits for token[i+2] = lm_head(mtp.norm(z_i))          (lm_head = embed_tokens, tied)

Checkpoint: config.json (a transformers Qwen3Config plus `num_nextn_predict_layers`), and
model.safetensors in bfloat16 with transformers' Qwen3 names, no `lm_head.weight` (tied).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyConfig:
    """Architecture hyperparameters; `to_hf_config` writes the transformers config.json."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    num_nextn_predict_layers: int = 1
    initializer_range: float = 0.02
    bos_token_id: int = 0
    eos_token_id: int = 0
    pad_token_id: int = 0

    def to_hf_config(self) -> dict[str, object]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "tie_word_embeddings": True,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, d: dict[str, object]) -> TinyConfig:
        kw = {k: d[k] for k in asdict(cls()) if k in d}
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            kw["rope_theta"] = d["rope_parameters"]["rope_theta"]  # type: ignore[index]
        return cls(**kw)  # type: ignore[arg-type]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    cfg: TinyConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, head_dim] for integer positions [T], as transformers computes them."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    )
    inv_freq = inv_freq.to(positions.device)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        cos_, sin_ = cos[None, None], sin[None, None]
        q = q * cos_ + _rotate_half(q) * sin_
        k = k * cos_ + _rotate_half(k) * sin_
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        if rep > 1:  # KV head j serves query heads j*rep .. j*rep+rep-1 (transformers' repeat_kv)
            kvh = k.shape[1]
            k = k[:, :, None].expand(b, kvh, rep, t, d).reshape(b, kvh * rep, t, d)
            v = v[:, :, None].expand(b, kvh, rep, t, d).reshape(b, kvh * rep, t, d)
        dt = q.dtype
        if torch.is_autocast_enabled(q.device.type):
            dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.dropout = dropout  # residual-branch dropout, training only (not part of Qwen3)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin)
        if self.training and self.dropout > 0:
            a = F.dropout(a, self.dropout)
        x = x + a
        m = self.mlp(self.post_attention_layernorm(x))
        if self.training and self.dropout > 0:
            m = F.dropout(m, self.dropout)
        return x + m


class Body(nn.Module):
    """Holds the `model.*` weights."""

    def __init__(self, cfg: TinyConfig, dropout: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, dropout) for _ in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(nn.Module):
    """Holds the `mtp.*` weights (one next-next-token layer)."""

    def __init__(self, cfg: TinyConfig, dropout: float) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, dropout)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)


class TinyQwen3(nn.Module):
    def __init__(self, cfg: TinyConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg, dropout)
        self.mtp = MTPHead(cfg, dropout)

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) for matrices, residual output projections scaled by
        1/sqrt(2 * layers), norms at 1. Deterministic for a seed (CPU generator)."""
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.initializer_range
        out_std = std / math.sqrt(2 * (self.cfg.num_hidden_layers + 1))
        for name, p in self.named_parameters():
            if p.dim() == 1:
                with torch.no_grad():
                    p.fill_(1.0)
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, s, generator=g)
            with torch.no_grad():
                p.copy_(w.to(p.device, p.dtype))

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.model.embed_tokens.weight.to(x.dtype))

    def forward_hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Main-model hidden states before the final norm, [B, T, H]."""
        x = self.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(self.cfg, positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return x

    def main_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def mtp_logits(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits for token[i+2] from h_i (pre-norm) and next_ids[i] = token[i+1]."""
        e = self.model.embed_tokens(next_ids).to(hidden.dtype)
        z = torch.cat((self.mtp.pre_fc_norm_embedding(e), self.mtp.pre_fc_norm_hidden(hidden)), -1)
        z = self.mtp.fc(z)
        cos, sin = rope_cos_sin(self.cfg, positions, z.dtype)
        for layer in self.mtp.layers:
            z = layer(z, cos, sin)
        return self.lm_head(self.mtp.norm(z))

    def forward(
        self, ids: torch.Tensor, next_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.forward_hidden(ids, positions)
        logits = self.main_logits(h)
        mtp = self.mtp_logits(h, next_ids, positions) if next_ids is not None else None
        return logits, mtp


def count_parameters(model: TinyQwen3) -> dict[str, int]:
    main = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model."))
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    emb = model.model.embed_tokens.weight.numel()
    return {"main": main, "mtp": mtp, "total": main + mtp, "embedding_tied": emb}


def save_checkpoint(model: TinyQwen3, out_dir: str | os.PathLike[str]) -> Path:
    """Write config.json and model.safetensors (bfloat16, transformers Qwen3 names)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        n: p.detach().to("cpu", torch.bfloat16).contiguous() for n, p in model.named_parameters()
    }
    save_file(
        dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    os.chmod(out / "model.safetensors", 0o644)
    (out / "config.json").write_text(json.dumps(model.cfg.to_hf_config(), indent=2) + "\n")
    return out / "model.safetensors"


def load_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TinyQwen3:
    from safetensors.torch import load_file

    d = Path(ckpt_dir)
    cfg = TinyConfig.from_hf_config(json.loads((d / "config.json").read_text()))
    model = TinyQwen3(cfg)
    sd = load_file(str(d / "model.safetensors"))
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return model.to(device=device, dtype=dtype).eval()
