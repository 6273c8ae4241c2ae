"""Start-up sizing and warm-up: the KV budget (measuring one forward's activation peak on
CUDA), capturing the decode graphs' reserve, and compiling the prefill and mixed-batch kernels
for the shapes serving meets first.

Owner: model-engine (called by the factory).

Invariants:
- `kv_budget_bytes` is the one KV-budget formula. On CUDA it is `total * utilization - memory
  in use after weights - activation peak of a forward at the token budget - graph reserve`;
  the activation peak is measured by a real profiling forward, except on hybrid models (the
  probe has no SSM pool), where it is the widest activation at the token budget. On the CPU
  it is `cpu_kv_cache_gb` less the bytes already reserved (the SSM pool).
- Capture happens after the KV pool exists (graphs bake in its addresses); the memory it took
  is measured and logged next to the reserve it was given.
- `warm_forward_shapes` runs throwaway sequences only and frees every block it took: the pool
  is exactly as before. Without it the first request of each new batch shape paid Triton's
  compilation in its time to first token (1.3-2.1 s on the H200).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from metrale.cache.block_pool import blocks_for
from metrale.cache.kv_cache import PagedKVCache
from metrale.config import EngineConfig
from metrale.model_engine.traits import PrefillSlice
from metrale.model_engine.transformer_model import TransformerModel
from metrale.models.config import ModelConfig

logger = logging.getLogger(__name__)

#: Memory kept aside for the decode graphs' private pool (they share one pool, sized by the
#: largest rung's activations, which the profiled prefill forward dominates).
GRAPH_RESERVE_BYTES = 1 << 30


@dataclass
class StartupBreakdown:
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    kv_bytes: int = 0
    graph_bytes: int = 0
    load_seconds: float = 0.0
    profile_seconds: float = 0.0
    capture_seconds: float = 0.0

    def summary(self) -> str:
        mib = 2**20
        return (
            f"weights {self.weights_bytes / mib:.0f} MiB in {self.load_seconds:.1f}s, "
            f"activations {self.activation_peak_bytes / mib:.0f} MiB "
            f"(profiled in {self.profile_seconds:.1f}s), KV {self.kv_bytes / mib:.0f} MiB, "
            f"graphs {self.graph_bytes / mib:.0f} MiB in {self.capture_seconds:.1f}s"
        )


def kv_budget_bytes(
    config: EngineConfig,
    mcfg: ModelConfig,
    module: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    ssm_bytes: int,
    breakdown: StartupBreakdown,
    *,
    hybrid: bool,
) -> int:
    """Bytes the KV pool may take (see the invariants). `ssm_bytes` (the SSM slot pool) come
    out of the CPU budget; on CUDA the free-memory reading already excludes the allocated
    pool. A `hybrid` model's activation peak is estimated, not profiled."""
    if device.type != "cuda":
        return int(config.cpu_kv_cache_gb * 2**30) - ssm_bytes
    tokens = config.resolved_batched_tokens("cuda")
    if hybrid:
        activation_peak = _estimated_activation_peak(tokens, mcfg)
    else:
        t0 = time.perf_counter()
        activation_peak = _profile_activation_peak(
            module, mcfg, device, dtype, tokens, max_model_len, config.block_size
        )
        breakdown.activation_peak_bytes = activation_peak
        breakdown.profile_seconds = time.perf_counter() - t0
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return (
        int(total * config.gpu_memory_utilization) - in_use - activation_peak - GRAPH_RESERVE_BYTES
    )


def _estimated_activation_peak(tokens: int, mcfg: ModelConfig) -> int:
    """One forward's activations and logits at `tokens` tokens, from the widest layer."""
    width = max(mcfg.hidden_size * 4, mcfg.intermediate_size * 3, mcfg.vocab_size)
    return tokens * width * 4


def _profile_activation_peak(
    module: torch.nn.Module,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tokens: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """Peak bytes one forward of `tokens` prefill tokens allocates beyond weights and KV."""
    blocks = blocks_for(tokens, block_size) + max(1, tokens // max(1, max_model_len - 1)) + 2
    kv = PagedKVCache(
        module.kv_layer_count, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
        dtype, device,
    )  # fmt: skip
    probe = TransformerModel(
        module, cfg, kv, device, dtype, max_model_len, enable_prefix_caching=False
    )
    per_seq = max(1, max_model_len - 1)
    slices = []
    remaining = tokens
    gen = torch.Generator().manual_seed(0)
    while remaining > 0:
        n = min(per_seq, remaining)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        slices.append(PrefillSlice(ids, probe.alloc_sequence(), 0, n, True))
        remaining -= n
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe.mixed_forward_batch([], [], slices)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    for sl in slices:
        probe.free_sequence(sl.seq)
    del probe, kv, slices
    torch.cuda.empty_cache()
    return peak


def warm_forward_shapes(model: Any, max_num_seqs: int) -> float:
    """Run the prefill, chunked-prefill and mixed decode+prefill forwards once for a spread of
    batch shapes (1 to 32 sequences, chunk lengths on and off a multiple of 16) so that Triton
    compiles their kernels now; returns the seconds it took. Recurrent (hybrid) models are
    skipped: their slot states would need the same care, and their recurrent ops are torch."""
    start = time.perf_counter()
    if model.ssm_pool is not None:
        return 0.0
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for count in sorted({1, 2, 3, 4, 8, 16, min(32, max_num_seqs)}):
        for length in (128, 127):
            need = count * (blocks_for(length + 8, model.block_size) + 1)
            if count > max_num_seqs or need > model.num_free_blocks() // 2:
                continue
            prompts = [
                torch.randint(0, vocab, (length + 8,), generator=gen).tolist() for _ in range(count)
            ]
            seqs = [model.alloc_sequence() for _ in prompts]
            try:
                model.mixed_forward_batch(
                    [], [], [PrefillSlice(p, s, 0, length, False) for p, s in zip(prompts, seqs)]
                )
                half = max(1, count // 2) if count > 1 else 0
                # Decode rows beside continuing chunks: the mixed path (and, with one
                # sequence, a chunk that starts after computed tokens).
                decode = [p[length] for p in prompts[:half]]
                chunks = [
                    PrefillSlice(p, s, length, 8, True) for p, s in zip(prompts[half:], seqs[half:])
                ]
                model.mixed_forward_batch(decode, seqs[:half], chunks)
            finally:
                for seq in seqs:
                    model.free_sequence(seq)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - start
