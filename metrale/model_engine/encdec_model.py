"""`EncoderDecoderModel`: the `Model` for M2M100/NLLB checkpoints (encoder-decoder), with
the decoder's self-attention KV in a paged pool and beam search (`generate_beam_batch`).

Owner: model-engine. Built by `load_encoder_decoder`; driven by the beam driver
(`metrale.model_engine.beam`, through the `BeamBackend` methods `beam_start_batch` /
`beam_fork` / `decode_batch` / `free_sequence`) and by the offline `Translator`.

Invariants:
- The encoder runs once per request (`beam_start_batch`: the sources of requests started
  together in padded batches, pad keys masked), and the cross-attention K/V of every
  decoder layer once per request; the request's sequences (all its beams) hold that one
  `CrossKv` in `layer_states[0]`, so a fork shares it and no forward recomputes it.
- Decoder self-attention K/V live in `kv_cache` under `block_pool`: a forward allocates the
  blocks its rows need all or nothing (`KVCacheExhausted` leaves every sequence unchanged);
  `free_sequence` drops exactly the sequence's block references and its `CrossKv` reference.
- Rows of one forward are grouped by request (contiguous, as the beam driver orders them);
  the groups' rows attend their sources in one attention call per layer (`CrossBatch`).
- On CUDA the LM head, the decoder's KV writes and its paged self-attention are the
  `KernelOps` of the device (Triton; `ENCDEC_OPS`, logged at load); the layers' projections
  (cuBLAS), layer norms, activations, the encoder's attention and the cross-attention (SDPA)
  are torch. A decoder step reads nothing back from the device, the beam driver reads it once
  per step.
- With `enable_step_graphs` a forward that fits runs through `EncDecStepGraphs` (CUDA graphs
  on a GPU), the others eagerly (counted there); each `CrossKv` counts the sequences holding
  it (`beam_start` 1, a fork +1, `free_sequence` -1) and gives its source slot back at 0.
- No decoder sequence passes `max_model_len` decoder tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from metrale.cache.block_pool import BlockPool
from metrale.cache.kv_cache import PagedKVCache
from metrale.errors import InvalidRequestError, KVCacheExhausted
from metrale.kernels import KernelOps, kernels_for
from metrale.model_engine.batch import ForwardRow, build_forward_batch
from metrale.model_engine.beam import BeamParams, BeamRequest, BeamSearchDriver
from metrale.model_engine.beam_backend import fork_state, freed_on_raise
from metrale.model_engine.encdec_graphs import EncDecStepGraphs
from metrale.model_engine.traits import BeamReq, Model, SequenceState, Stream
from metrale.models.m2m100 import CrossKv, M2M100ForConditionalGeneration
from metrale.models.m2m100_config import M2M100Config

logger = logging.getLogger(__name__)

#: The `KernelOps` entries the M2M100 model calls (reported at load).
ENCDEC_OPS = ("linear", "write_kv", "paged_attention")

#: Sources encoded together at most (one padded encoder pass).
ENCODER_BATCH = 64
#: The decoder KV pool's default size: this many bytes, at most `MAX_DEFAULT_BLOCKS` blocks.
DEFAULT_KV_BUDGET_BYTES = 1 << 30
MAX_DEFAULT_BLOCKS = 4096


class EncoderDecoderModel(Model):
    def __init__(
        self,
        module: M2M100ForConditionalGeneration,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        cfg = module.config
        self.module = module
        self.config = cfg
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.kv_cache = PagedKVCache(
            cfg.decoder_layers,
            num_blocks,
            block_size,
            cfg.decoder_attention_heads,
            cfg.head_dim,
            dtype,
            device,
        )
        self.block_pool = BlockPool(num_blocks)
        self._next_slot = 0
        #: Sources encoded (one per request started), and the padded encoder batches run.
        self.encoder_passes = 0
        self.encoder_batches = 0
        self.decoder_forwards = 0
        #: The decoder step over static buffers (CUDA graphs on a GPU), or None: eager.
        self.step_graphs: EncDecStepGraphs | None = None

    def enable_step_graphs(
        self, *, max_rows: int = 128, max_sources: int = 64, source_cap: int = 128
    ) -> EncDecStepGraphs:
        """Run decoder steps of up to `max_rows` rows through `EncDecStepGraphs` (captured
        now on CUDA). Call it while no request runs: sources encoded before have no slot."""
        graphs = EncDecStepGraphs(
            self.module, self.kv_cache.layers, self.block_size, self.max_model_len,
            self.device, self.dtype, max_rows=max_rows, max_sources=max_sources,
            source_cap=source_cap,
        )  # fmt: skip
        graphs.capture()
        self.step_graphs = graphs
        return graphs

    # ---------------------------------------------------------------- facts

    def vocab_size(self) -> int:
        return self.config.vocab_size

    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.config.eos_token_id})

    def max_context_len(self) -> int:
        return self.max_model_len

    def device_name(self) -> str:
        return str(self.device)

    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def num_total_blocks(self) -> int:
        return self.block_pool.num_usable

    def kv_block_size(self) -> int:
        return self.block_size

    def supports_beam(self) -> bool:
        return True

    # ---------------------------------------------------------------- lifecycle

    def alloc_sequence(self) -> SequenceState:
        seq = SequenceState(slot_idx=self._next_slot)
        self._next_slot += 1
        return seq

    def cache_sequence(self, seq: SequenceState) -> None:
        """No prefix cache: decoder prefixes depend on the source, which a token key lacks."""

    def free_sequence(self, seq: SequenceState) -> None:
        if seq.layer_states and isinstance(seq.layer_states[0], CrossKv):
            cross = seq.layer_states[0]
            cross.holders -= 1
            if cross.holders == 0 and self.step_graphs is not None:
                self.step_graphs.detach(cross)
        if seq.block_table:
            self.block_pool.decref(seq.block_table)
        seq.block_table = []
        seq.seq_len = seq.kv_valid_tokens = 0
        seq.tokens = []
        seq.layer_states = []

    # ---------------------------------------------------------------- encoder

    def encode_source(self, seq: SequenceState, source: Sequence[int]) -> None:
        """Run the encoder on `source` and keep its cross-attention K/V in `seq`."""
        self.encode_sources([seq], [source])

    def encode_sources(
        self, seqs: Sequence[SequenceState], sources: Sequence[Sequence[int]]
    ) -> None:
        """Encode every source (in padded batches of at most `ENCODER_BATCH`) and keep each
        one's cross-attention K/V in its sequence. Every source is checked before any runs."""
        limit = self.module.positions.shape[0] - self.config.pad_token_id - 2
        for source in sources:
            if not source:
                raise InvalidRequestError("the source has no tokens", param="prompt")
            if len(source) > limit:
                raise InvalidRequestError(
                    f"the source has {len(source)} tokens, over the model's {limit} positions",
                    param="prompt",
                )
        for at in range(0, len(sources), ENCODER_BATCH):
            chunk = [list(s) for s in sources[at : at + ENCODER_BATCH]]
            encoded = self.module.encode_batch(chunk)
            crosses = self.module.cross_kv_batch(encoded, chunk)
            self.encoder_batches += 1
            for seq, cross in zip(seqs[at : at + ENCODER_BATCH], crosses, strict=True):
                cross.holders = 1
                seq.layer_states = [cross]
                if self.step_graphs is not None:
                    self.step_graphs.attach(cross)
                self.encoder_passes += 1

    # ---------------------------------------------------------------- beam backend

    def beam_start(self, req: BeamRequest) -> SequenceState:
        """Encode the request's source; the decoder prompt's tokens but the last are fed."""
        return self.beam_start_batch([req])[0]

    def beam_start_batch(self, reqs: Sequence[BeamRequest]) -> list[SequenceState]:
        """`beam_start` of every request, their sources encoded together; a raise frees
        every sequence made."""
        with freed_on_raise(self.free_sequence) as seqs:
            for req in reqs:
                if req.source is None:
                    raise InvalidRequestError(
                        "an encoder-decoder request needs a source", param="prompt"
                    )
                seq = self.alloc_sequence()
                seqs.append(seq)
                p = req.params
                seq.src_lang_id = req.source[0] if req.source else 0
                seq.tgt_lang_id = req.forced[0] if req.forced else 0
                seq.num_beams, seq.length_penalty = p.num_beams, p.length_penalty
                seq.early_stopping = p.early_stopping
            self.encode_sources(seqs, [r.source or [] for r in reqs])
            for req, seq in zip(reqs, seqs, strict=True):
                # A longer decoder prompt: feed all but its last token, one at a time.
                for tok in req.prompt[:-1]:
                    self.decode_batch([tok], [seq])
        return seqs

    def beam_fork(self, seq: SequenceState) -> SequenceState:
        child = fork_state(seq, self.alloc_sequence())
        self.block_pool.incref(child.block_table)
        if child.layer_states and isinstance(child.layer_states[0], CrossKv):
            child.layer_states[0].holders += 1
        return child

    # ---------------------------------------------------------------- forward

    def prefill_chunk(
        self,
        tokens: Sequence[int],
        seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last_chunk: bool,
        stream: Stream = None,
    ) -> torch.Tensor | None:
        """Feed decoder tokens `tokens[chunk_start:+chunk_len]` one forward row at a time
        (the source must have been encoded into `seq` first)."""
        logits = None
        for tok in tokens[chunk_start : chunk_start + chunk_len]:
            logits = self.decode_batch([tok], [seq])
        return logits if is_last_chunk else None

    @torch.inference_mode()
    def decode_batch(
        self, tokens: Sequence[int], seqs: Sequence[SequenceState], stream: Stream = None
    ) -> torch.Tensor:
        if len(tokens) != len(seqs):
            raise ValueError("tokens and seqs differ in length")
        if not seqs:
            raise ValueError("decode_batch needs at least one row")
        bs, limit = self.block_size, self.max_model_len
        # The rows' checks and block needs as list comprehensions (a 128-row step's host side).
        if [s for s in seqs if not (s.layer_states and isinstance(s.layer_states[0], CrossKv))]:
            raise ValueError("a decoder row's sequence has no encoded source")
        lens = [s.seq_len for s in seqs]
        if max(lens) >= limit:
            raise InvalidRequestError(
                f"decoder sequence would reach {max(lens) + 1} tokens, over max_model_len {limit}"
            )
        # `blocks_needed(s, 1, bs)` inline (a call per row costs), <= 0 meaning none.
        needs = [-(-(n + 1) // bs) - len(s.block_table) for n, s in zip(lens, seqs)]
        total = sum([n for n in needs if n > 0])
        if total > self.block_pool.num_free:
            raise KVCacheExhausted(
                f"KV cache exhausted: this forward needs {total} blocks, "
                f"{self.block_pool.num_free} free"
            )
        if total:
            fresh = self.block_pool.allocate(total)  # one pool call for the step
            at = 0
            for s, n in zip(seqs, needs):
                if n > 0:
                    s.block_table.extend(fresh[at : at + n])
                    at += n
        graphs = self.step_graphs
        if graphs is not None and graphs.fits(list(seqs)):
            logits = graphs.run([int(t) for t in tokens], list(seqs))
        else:
            rows = [ForwardRow(s, [int(t)], True) for t, s in zip(tokens, seqs)]
            batch = build_forward_batch(rows, len(rows), self.block_size, self.device)
            groups: list[tuple[int, int, CrossKv]] = []
            for i, s in enumerate(seqs):
                cross = s.layer_states[0]
                if groups and groups[-1][2] is cross:
                    groups[-1] = (groups[-1][0], i + 1, cross)
                else:
                    groups.append((i, i + 1, cross))
            hidden = self.module.decode(batch.input_ids, batch.meta, self.kv_cache.layers, groups)
            logits = self.module.compute_logits(hidden)
        for s, t in zip(seqs, tokens):
            s.tokens.append(int(t))
            s.seq_len += 1
            s.kv_valid_tokens = s.seq_len
        self.decoder_forwards += 1
        return logits

    def generate_beam_batch(self, reqs: Sequence[BeamReq]) -> list[list[int]]:
        """The seed's entry point: each request's best hypothesis (target language code
        forced first, not returned; the request's source gets `[src] ... </s>` added)."""
        work = []
        for i, r in enumerate(reqs):
            if not r.src_lang_id or not r.tgt_lang_id:
                raise InvalidRequestError("generate_beam_batch needs src_lang_id and tgt_lang_id")
            params = BeamParams(
                num_beams=r.num_beams,
                length_penalty=r.length_penalty,
                early_stopping=r.early_stopping,
                max_tokens=max(1, r.max_new),
            )
            source = [r.src_lang_id, *r.prompt_tokens, self.config.eos_token_id]
            work.append(
                BeamRequest(
                    f"beam-{i}",
                    [self.config.decoder_start_token_id],
                    params,
                    source,
                    [r.tgt_lang_id],
                )
            )
        outs = BeamSearchDriver(self, [self.config.eos_token_id]).run(work)
        return [o.hypotheses[0].token_ids for o in outs]


def load_encoder_decoder(
    model_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_model_len: int = 256,
    num_blocks: int | None = None,
    block_size: int = 16,
    kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES,
    ops: KernelOps | None = None,
    kv_cache_dtype: str = "auto",
) -> EncoderDecoderModel:
    """Build and load an M2M100/NLLB checkpoint. The decoder KV pool holds `num_blocks`
    blocks; None sizes it to `kv_budget_bytes` (at most `MAX_DEFAULT_BLOCKS`). The pool is
    in the model dtype: `kv_cache_dtype` other than "auto" (float8 KV) is refused."""
    if kv_cache_dtype != "auto":
        raise InvalidRequestError(
            f"kv_cache_dtype '{kv_cache_dtype}' is not supported by the encoder-decoder "
            "(M2M100/NLLB) model: its attention reads the model dtype; use auto",
            param="kv_cache_dtype",
        )
    dev = torch.device(device)
    cfg = M2M100Config.from_dir(model_dir)
    ops = ops or kernels_for(dev)
    used = {name: ops.implementations.get(name, "torch") for name in ENCDEC_OPS}
    logger.info("M2M100 kernels on %s: %s (the rest: torch)", dev, used)
    module = M2M100ForConditionalGeneration(cfg, ops, max_model_len)
    module.load_checkpoint(model_dir)
    module.to(device=dev, dtype=dtype).eval().requires_grad_(False)
    module.positions = module.positions.to(dev)
    if num_blocks is None:
        per_block = PagedKVCache.bytes_per_block(
            cfg.decoder_layers, block_size, cfg.decoder_attention_heads, cfg.head_dim, dtype
        )
        num_blocks = min(MAX_DEFAULT_BLOCKS, max(2, kv_budget_bytes // per_block))
    if num_blocks < 2:
        raise ValueError("the decoder KV pool needs at least 2 blocks")
    logger.info(
        "loaded %s: %d encoder + %d decoder layers, d_model %d; decoder KV %d blocks of %d "
        "(%d tokens)",
        Path(model_dir).name,
        cfg.encoder_layers,
        cfg.decoder_layers,
        cfg.d_model,
        num_blocks - 1,
        block_size,
        (num_blocks - 1) * block_size,
    )
    return EncoderDecoderModel(module, num_blocks, block_size, dev, dtype, max_model_len)
