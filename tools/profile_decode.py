"""Where one batch-1 decode step's GPU time goes: torch.profiler over eager decode steps of a
dummy-weight model (graphs off so every kernel is attributed). Usage:
    PYTHONPATH=. python3 tools/profile_decode.py bench/configs/qwen3-8b [steps]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from metrale import Engine, EngineConfig, SamplingParams
from metrale.bench.synthetic import prepare_model_dir


def main() -> None:
    config_dir = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    engine = Engine(
        EngineConfig(
            model=str(prepare_model_dir(config_dir)), load_format="dummy", max_model_len=2048,
            max_num_seqs=8, enforce_eager=True, enable_prefix_caching=False,
        )
    )  # fmt: skip
    engine.add_request(
        "p", list(range(100, 228)), SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    )
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )


if __name__ == "__main__":
    main()
