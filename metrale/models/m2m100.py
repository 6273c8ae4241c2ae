"""The M2M100 / NLLB encoder-decoder (`M2M100ForConditionalGeneration`): module and
checkpoint loading (its `config.json` is `m2m100_config.py`'s).

Owner: models. `metrale.model_engine.encdec_model.EncoderDecoderModel` drives it: it runs
`encode` once per request, `cross_kv` once per request, and `decode` over the rows of every
running sequence, with the decoder's self-attention KV in a paged cache.

Invariants:
- Parameter names equal transformers' (`model.encoder.layers.N.self_attn.q_proj.weight`,
  `model.shared.weight`, ...). The encoder and decoder token embeddings are the shared matrix;
  logits use it too unless `tie_word_embeddings` is false (then `lm_head.weight`).
- Token embeddings are multiplied by `sqrt(d_model)` exactly when `scale_embedding` is set;
  positions are the fairseq sinusoidal table (offset 2, the padding row zero) added to them;
  every layer is pre-norm and both stacks end in their `layer_norm`, as in the checkpoint.
- Positions: a token equal to `pad_token_id` takes the padding row (zeros); the encoder numbers
  the other tokens `pad + 1, pad + 2, ...` in order, the decoder its token at index `i`
  `pad + 1 + i` (transformers' numbering for one token per step).
- `decode` reads cross-attention K/V only from the per-row `CrossKv` it is given and the
  self-attention K/V only through the metadata's slots and block tables. All requests' rows
  of a forward attend their sources in one masked call per layer (`CrossBatch`).
- `encode`, `cross_kv` and `decode` read nothing back from the device: position bounds and
  padding come from the host's token lists, host facts go up in asynchronous copies.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from metrale.errors import CheckpointError
from metrale.kernels import KernelOps
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.common import LayerCaches
from metrale.models.loader import checkpoint_files, iter_tensors
from metrale.models.m2m100_config import ACTIVATIONS, M2M100Config

logger = logging.getLogger(__name__)


def sinusoidal_table(num_embeddings: int, dim: int, padding_idx: int) -> torch.Tensor:
    """The fairseq/tensor2tensor sinusoidal table, row `padding_idx` zero (float32)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(num_embeddings, dtype=torch.int64).float().unsqueeze(1) * freqs[None]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(num_embeddings, -1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(num_embeddings, 1)], dim=1)
    table[padding_idx, :] = 0
    return table


@dataclass
class CrossKv:
    """One request's cross-attention keys and values, per decoder layer `(k, v)` of
    `[heads, source_len, head_dim]`; computed once, shared by every beam of the request."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    #: `[source_len]` bool, True where the source token is padding (masked), or None.
    pad_mask: torch.Tensor | None
    #: The same on the host: the padding positions (empty: none).
    pad_positions: tuple[int, ...] = ()
    #: Sequences holding it (the request's live beams), kept by the model.
    holders: int = 0
    #: Its slot in the step graphs' source pool (`EncDecStepGraphs`), or None.
    pool_slot: int | None = None

    @property
    def source_len(self) -> int:
        return int(self.layers[0][0].shape[1])


class CrossBatch:
    """The cross-attention of one decoder forward: which rows read which request's source.

    One request (a batch-1 translation): its rows attend its K/V directly. Several: each
    layer's K/V of all requests are gathered into `[requests, heads, longest source, dim]`,
    the rows scattered into `[requests, beams, ...]` (a request's rows are contiguous), and
    one masked attention call serves them all (padding keys and sources shorter than the
    longest are masked). The layout is built once per forward on the host and sent in one
    asynchronous copy."""

    def __init__(self, groups: list[tuple[int, int, CrossKv]], device: torch.device) -> None:
        if not groups or any(
            start != (groups[i - 1][1] if i else 0) or end <= start
            for i, (start, end, _) in enumerate(groups)
        ):
            raise ValueError("cross-attention groups must cover the rows in order, each non-empty")
        self.crosses = [c for _, _, c in groups]
        lens = [c.source_len for c in self.crosses]
        self.single = len(groups) == 1
        if self.single:
            cross = self.crosses[0]
            self.mask = None if cross.pad_mask is None else ~cross.pad_mask[None, None, None, :]
            return
        self.g, self.s_max = len(groups), max(lens)
        self.q_max = max(end - start for start, end, _ in groups)
        key_index: list[int] = []
        valid: list[int] = []
        row_slot: list[int] = []
        offset = 0
        for g, ((start, end, cross), n) in enumerate(zip(groups, lens, strict=True)):
            pads = set(cross.pad_positions)
            key_index += [offset + min(i, n - 1) for i in range(self.s_max)]
            valid += [int(i < n and i not in pads) for i in range(self.s_max)]
            row_slot += [g * self.q_max + i for i in range(end - start)]
            offset += n
        packed = torch.tensor([*key_index, *valid, *row_slot], dtype=torch.int64)
        up = packed.to(device, non_blocking=True)
        span = self.g * self.s_max
        self.key_index, self.row_slot = up[:span], up[2 * span :]
        masked = not all(valid)
        self.mask = up[span : 2 * span].view(self.g, 1, 1, self.s_max).bool() if masked else None

    def attend(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """Rows `q` `[R, heads, dim]` attend their request's source at `layer`."""
        if self.single:
            ck, cv = self.crosses[0].layers[layer]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], ck[None], cv[None], attn_mask=self.mask, scale=scale
            )[0]
            return o.transpose(0, 1)
        heads, dim = q.shape[1], q.shape[2]
        shape = (heads, self.g, self.s_max, dim)
        k = torch.cat([c.layers[layer][0] for c in self.crosses], dim=1)
        v = torch.cat([c.layers[layer][1] for c in self.crosses], dim=1)
        k = k.index_select(1, self.key_index).view(shape).transpose(0, 1)
        v = v.index_select(1, self.key_index).view(shape).transpose(0, 1)
        qp = q.new_zeros(self.g * self.q_max, heads, dim).index_copy_(0, self.row_slot, q)
        qp = qp.view(self.g, self.q_max, heads, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=self.mask, scale=scale)
        return o.transpose(1, 2).reshape(-1, heads, dim).index_select(0, self.row_slot)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = d // heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, d]` -> `[heads, T, head_dim]`."""
        return x.view(x.shape[0], self.heads, self.head_dim).transpose(0, 1)


class _Layer(nn.Module):
    """What both layers hold (under transformers' names): pre-norm self-attention and the
    pre-norm feed-forward block `fc2(act(fc1(.)))`."""

    def __init__(self, d: int, heads: int, ffn: int, act: str) -> None:
        super().__init__()
        self.self_attn = _Attention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = ACTIVATIONS[act]

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` plus the feed-forward block of its final-norm."""
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class EncoderLayer(_Layer):
    def __init__(self, cfg: M2M100Config) -> None:
        super().__init__(
            cfg.d_model, cfg.encoder_attention_heads, cfg.encoder_ffn_dim, cfg.activation_function
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """`x` `[B, S, d]`; `key_mask` `[B, S]` True where a key may be attended (None: all)."""
        a = self.self_attn
        batch, length, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, a.heads, a.head_dim).transpose(1, 2)

        h = self.self_attn_layer_norm(x)
        q, k, v = heads(a.q_proj(h)), heads(a.k_proj(h)), heads(a.v_proj(h))
        mask = key_mask[:, None, None, :] if key_mask is not None else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.scaling)
        x = x + a.out_proj(o.transpose(1, 2).reshape(batch, length, d))
        return self.feed_forward(x)


class DecoderLayer(_Layer):
    def __init__(self, cfg: M2M100Config, ops: KernelOps) -> None:
        d = cfg.d_model
        super().__init__(
            d, cfg.decoder_attention_heads, cfg.decoder_ffn_dim, cfg.activation_function
        )
        self.encoder_attn = _Attention(d, cfg.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.ops = ops

    def forward(self, x: torch.Tensor, attn: DecoderAttention, layer: int) -> torch.Tensor:
        """One decoder layer over rows `x` `[R, d]`; `attn` supplies both attentions (the
        eager forward's `EagerAttention`, or a graph body's static form)."""
        a = self.self_attn
        heads, dim = a.heads, a.head_dim
        h = self.self_attn_layer_norm(x)
        q = a.q_proj(h).view(-1, heads, dim)
        k = a.k_proj(h).view(-1, heads, dim)
        v = a.v_proj(h).view(-1, heads, dim)
        o = attn.self_attend(q, k, v, layer, a.scaling)
        x = x + a.out_proj(o.reshape(x.shape))
        c = self.encoder_attn
        h = self.encoder_attn_layer_norm(x)
        q = c.q_proj(h).view(-1, heads, dim)
        out = attn.cross_attend(q, layer, c.scaling)
        x = x + c.out_proj(out.reshape(x.shape))
        return self.feed_forward(x)


class DecoderAttention(Protocol):
    """The two attentions of a decoder forward, per layer: self-attention writes the rows'
    K/V and attends the sequence so far; cross-attention attends the row's source."""

    def self_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
    ) -> torch.Tensor: ...

    def cross_attend(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor: ...


class EagerAttention:
    """The eager forward's attentions: the kernel ops' paged KV write and attention over
    `meta`, and a `CrossBatch`."""

    def __init__(
        self,
        ops: KernelOps,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
        cross: CrossBatch,
    ) -> None:
        self.ops, self.meta, self.kv_caches, self.cross = ops, meta, kv_caches, cross

    def self_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
    ) -> torch.Tensor:
        kc, vc = self.kv_caches[layer]
        self.ops.write_kv(k, v, kc, vc, self.meta.slot_mapping)
        return self.ops.paged_attention(q, kc, vc, self.meta, scale)

    def cross_attend(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        return self.cross.attend(q, layer, scale)


class _Stack(nn.Module):
    def __init__(self, layers: list[nn.Module], d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layer_norm = nn.LayerNorm(d)


class _Inner(nn.Module):
    def __init__(self, cfg: M2M100Config, ops: KernelOps) -> None:
        super().__init__()
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = _Stack([EncoderLayer(cfg) for _ in range(cfg.encoder_layers)], cfg.d_model)
        self.decoder = _Stack(
            [DecoderLayer(cfg, ops) for _ in range(cfg.decoder_layers)], cfg.d_model
        )


class M2M100ForConditionalGeneration(nn.Module):
    """The encoder-decoder; see the module docstring for what each method reads."""

    def __init__(self, cfg: M2M100Config, ops: KernelOps, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.model = _Inner(cfg, ops)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        rows = max(max_positions, cfg.max_position_embeddings) + cfg.pad_token_id + 3
        self.register_buffer(
            "positions", sinusoidal_table(rows, cfg.d_model, cfg.pad_token_id), persistent=False
        )

    @property
    def kv_layer_count(self) -> int:
        return self.config.decoder_layers

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """Scaled token embeddings plus positions; `max_position` bounds `positions` (known on
        the host, so the check reads nothing back from the device)."""
        if max_position >= self.positions.shape[0]:
            raise ValueError(
                f"position {max_position} is past the model's table of "
                f"{self.positions.shape[0]} positions"
            )
        tok = self.model.shared(ids) * self.embed_scale
        pos = self.positions.index_select(0, positions.reshape(-1)).view(*positions.shape, -1)
        return tok + pos.to(tok.dtype)

    @torch.inference_mode()
    def encode(self, source: list[int]) -> torch.Tensor:
        """The encoder's output `[S, d]` for one source sequence (after its final norm)."""
        return self.encode_batch([source])[0]

    @torch.inference_mode()
    def encode_batch(self, sources: list[list[int]]) -> torch.Tensor:
        """The encoder's outputs `[B, S, d]` for sources right-padded to the longest `S` with
        the pad token (masked as keys, at the padding position, as transformers batches
        them); row `i` is meaningful up to `len(sources[i])`."""
        device = self.model.shared.weight.device
        pad = self.config.pad_token_id
        width = max(len(s) for s in sources)
        ids: list[int] = []
        positions: list[int] = []
        for source in sources:
            count = 0
            for t in source:  # pad tokens take the padding row, the others pad + 1, pad + 2...
                count += t != pad
                positions.append(count + pad if t != pad else pad)
            ids += [*source, *([pad] * (width - len(source)))]
            positions += [pad] * (width - len(source))
        up = torch.tensor([ids, positions], dtype=torch.int64).to(device, non_blocking=True)
        ids_t, pos_t = up[0].view(len(sources), width), up[1].view(len(sources), width)
        key_mask = ids_t.ne(pad) if pad in ids else None
        x = self._embed(ids_t, pos_t, max(positions))
        for layer in self.model.encoder.layers:
            x = layer(x, key_mask)
        return self.model.encoder.layer_norm(x)

    @torch.inference_mode()
    def cross_kv(self, encoded: torch.Tensor, source: list[int]) -> CrossKv:
        """Every decoder layer's cross-attention K/V of one encoded source `[S, d]`."""
        return self.cross_kv_batch(encoded[None], [source])[0]

    @torch.inference_mode()
    def cross_kv_batch(self, encoded: torch.Tensor, sources: list[list[int]]) -> list[CrossKv]:
        """Each source's cross-attention K/V of every decoder layer, from `encode_batch`'s
        `[B, S, d]` (one projection per layer for the batch; each source keeps views of its
        rows)."""
        batch, width, _ = encoded.shape
        per_source: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in sources]
        for layer in self.model.decoder.layers:
            c = layer.encoder_attn
            k = c.k_proj(encoded).view(batch, width, c.heads, c.head_dim).transpose(1, 2)
            v = c.v_proj(encoded).view(batch, width, c.heads, c.head_dim).transpose(1, 2)
            for i, source in enumerate(sources):
                per_source[i].append((k[i, :, : len(source)], v[i, :, : len(source)]))
        pad = self.config.pad_token_id
        out = []
        for source, layers in zip(sources, per_source, strict=True):
            at = tuple(i for i, t in enumerate(source) if t == pad)
            if not at:
                out.append(CrossKv(layers, None))
                continue
            pads = torch.tensor([t == pad for t in source]).to(encoded.device, non_blocking=True)
            out.append(CrossKv(layers, pads, at))
        return out

    def decoder_positions(self, ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Positions of decoder tokens `ids` at sequence indices `index`."""
        pad = self.config.pad_token_id
        keep = ids.ne(pad).long()
        return (index + 1) * keep + pad

    @torch.inference_mode()
    def decode(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
        groups: list[tuple[int, int, CrossKv]],
    ) -> torch.Tensor:
        """Decoder hidden rows after the final norm; `groups` lists `(first row, end row,
        CrossKv)` covering every row once (the rows of one request are contiguous)."""
        # A row at sequence index i sits at position pad + 1 + i < pad + 1 + its length.
        if meta.seq_lens_host:
            top = max(meta.seq_lens_host) + self.config.pad_token_id
        else:
            top = int(meta.positions.max()) + 1 + self.config.pad_token_id
        x = self._embed(input_ids, self.decoder_positions(input_ids, meta.positions), top)
        if len(kv_caches) != len(self.model.decoder.layers):
            raise ValueError("one KV cache per decoder layer is needed")
        attn = EagerAttention(self.ops, meta, kv_caches, CrossBatch(groups, input_ids.device))
        return self.run_decoder(x, attn)

    def run_decoder(self, x: torch.Tensor, attn: DecoderAttention) -> torch.Tensor:
        """The decoder stack and its final norm over embedded rows `x`."""
        for i, layer in enumerate(self.model.decoder.layers):
            x = layer(x, attn, i)
        return self.model.decoder.layer_norm(x)

    def embed_decoder(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decoder rows' embeddings at table rows `positions` (no bound check: the caller's
        positions are known in range)."""
        tok = self.model.shared(ids) * self.embed_scale
        return tok + self.positions.index_select(0, positions).to(tok.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = (
            self.model.shared.weight if self.config.tie_word_embeddings else self.lm_head.weight
        )
        return self.ops.linear(hidden, weight).float()

    def load_checkpoint(self, model_dir: str | Path) -> int:
        """Fill every parameter from the checkpoint's safetensors; returns the tensor count.
        A missing tensor or a shape mismatch is a `CheckpointError` naming it."""
        params = dict(self.named_parameters())
        aliases = {
            "model.encoder.embed_tokens.weight": "model.shared.weight",
            "model.decoder.embed_tokens.weight": "model.shared.weight",
        }
        if self.config.tie_word_embeddings:
            aliases["lm_head.weight"] = "model.shared.weight"
        written: set[str] = set()
        ignored: list[str] = []
        count = 0
        for name, tensor, path in iter_tensors(checkpoint_files(model_dir)):
            if name.endswith("embed_positions.weights") or name.endswith(
                "embed_positions._float_tensor"
            ):
                continue
            target = name if name in params else aliases.get(name)
            if target is None:
                ignored.append(name)
                continue
            if target in written and target != name:
                continue  # a tied copy of a tensor already loaded
            param = params[target]
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{path}: tensor {name} has shape {tuple(tensor.shape)}, the config "
                    f"implies {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            written.add(target)
            count += 1
        missing = sorted(set(params) - written)
        if missing:
            raise CheckpointError(
                f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}"
            )
        if ignored:
            logger.info(
                "ignored %d checkpoint tensor(s) unused by M2M100: %s", len(ignored), ignored[:5]
            )
        return count
