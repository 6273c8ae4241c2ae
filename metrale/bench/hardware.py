"""Device ceilings measured in the same run as a benchmark: device-to-device copy bandwidth.

Owner: bench.

Invariants:
- Bandwidth counts bytes read plus bytes written, over the median of repeated copies of a
  buffer several times larger than the L2 cache, after a warm-up.
"""

from __future__ import annotations

import statistics

import torch


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)
