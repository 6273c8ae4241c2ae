"""CUDA start-up: measuring one forward's activation peak, sizing the KV pool from the memory
left under `gpu_memory_utilization`, and capturing the decode graphs.

Owner: model-engine (called by the factory on CUDA only).

Invariants:
- The KV budget is `total * utilization - memory in use after weights - activation peak of a
  forward at the token budget - graph reserve`; it is computed after a real profiling forward,
  never guessed from the config alone.
- Capture happens after the KV pool exists (graphs bake in its addresses); the memory it took
  is measured and logged next to the reserve it was given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from metrale.cache.kv_cache import PagedKVCache
from metrale.model_engine.traits import PrefillSlice

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


def profile_activation_peak(
    module: torch.nn.Module,
    model_cls: type,
    model_args: dict,
    tokens: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """Peak bytes one forward of `tokens` prefill tokens allocates beyond weights and KV."""
    device = model_args["device"]
    cfg = model_args["config"]
    blocks = -(-tokens // block_size) + max(1, tokens // max(1, max_model_len - 1)) + 2
    kv = PagedKVCache(
        module.kv_layer_count, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
        model_args["dtype"], device,
    )  # fmt: skip
    probe = model_cls(module=module, kv_cache=kv, enable_prefix_caching=False, **model_args)
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


def cuda_kv_budget(utilization: float, activation_peak: int, device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return int(total * utilization) - in_use - activation_peak - GRAPH_RESERVE_BYTES
