"""The bench record of one `tools/cpu_ladder.sh` run: metrale's and the peers' figures per
model size and concurrency rung, read from the ladder's `$OUT/<engine>-<size>.json`.

    PYTHONPATH=. .venv/bin/python tools/cpu_ladder_record.py OUT_DIR [--busy 0|1]

Writes bench/records/<time>-cpu-ladder-qwen3-small-and-tiny-random.json (instrument
"cpu-ladder"): `figures[size]` are metrale's, `peer_figures["<engine>-<size>"]` the peers';
each rung carries tok/s, TTFT and TPOT p50/p90, errors and ok, and `checks` states issue
26's bars against them (C=1 TPOT, C=16 tok/s against vLLM-CPU, TTFT p90 <= 3x p50).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from metrale.bench.record import write_record

KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "errors", "ok")
#: Issue 26's C=1 TPOT p50 bars, ms.
TPOT_BAR = {"small": 3.0, "tiny": 0.4}


def rungs(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    out: dict[str, Any] = {"startup_s": data.get("startup_s")}
    for r in data["rungs"]:
        out[f"C={r['concurrency']}"] = {k: r.get(k) for k in KEYS}
    return out


def checks(size: str, ours: dict[str, Any], vllm: dict[str, Any] | None) -> dict[str, Any]:
    c1, c16 = ours.get("C=1", {}), ours.get("C=16", {})
    result: dict[str, Any] = {
        f"tpot_p50_c1_le_{TPOT_BAR[size]}ms": (c1.get("tpot_p50_ms") or 1e9) <= TPOT_BAR[size],
        "ttft_p90_le_3x_p50_every_rung": all(
            (r["ttft_p90_ms"] or 0) <= 3 * (r["ttft_p50_ms"] or 0)
            for k, r in ours.items()
            if k.startswith("C=")
        ),
    }
    if size == "small":
        result["c16_tok_s_ge_1000"] = (c16.get("output_tok_s") or 0) >= 1000
        if vllm is not None and "C=16" in vllm:
            result["c16_ahead_of_vllm"] = (c16.get("output_tok_s") or 0) > (
                vllm["C=16"]["output_tok_s"] or 0
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--busy", default="0", help="1: a second process spun on one core")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    peers: dict[str, Any] = {}
    for path in sorted(args.out.glob("*-*.json")):
        engine, size = path.stem.rsplit("-", 1)
        if size not in TPOT_BAR:
            continue
        if engine == "metrale":
            figures[size] = rungs(path)
            ready = path.with_suffix(".ready")
            if ready.exists():
                figures[size]["ready_after_s"] = float(ready.read_text())
        else:
            peers[f"{engine}-{size}"] = rungs(path)
    if not figures:
        raise SystemExit(f"no metrale-<size>.json under {args.out}")
    for size, ours in figures.items():
        ours["checks"] = checks(size, ours, peers.get(f"vllm-{size}"))
    record = write_record(
        "cpu-ladder",
        model_shape="qwen3-small-and-tiny-random",
        config={
            "models": "peers_cpu/make_model.py --size small|tiny (random Qwen3, vocab 512, "
            "head_dim 64, float32)",
            "isl": 64,
            "osl": 64,
            "requests_per_rung": 32,
            "concurrency": [1, 4, 16],
            "client": "peers_cpu/run.py (streaming /v1/completions, token-id prompts, greedy, "
            "ignore_eos)",
            "metrale": "metrale serve DIR (float32, CPU; engine threads by its policy)",
            "metrale_args": os.environ.get("METRALE_ARGS", ""),
            "metrale_cpu_linear": os.environ.get("METRALE_CPU_LINEAR", "auto"),
            "metrale_cpu_decode": os.environ.get("METRALE_CPU_DECODE", "fused"),
            "metrale_cpu_weights": os.environ.get("METRALE_CPU_WEIGHTS", "float32"),
            "peers": "llama-server (f32 GGUF, -t 2) and vLLM-CPU (float32), started by run.py",
            "busy_core": args.busy == "1",
        },
        figures=figures,
        peer_figures=peers or None,
        device="cpu",
    )
    for size, ours in figures.items():
        print(size, {k: v["tpot_p50_ms"] for k, v in ours.items() if k.startswith("C=")},
              {k: v["output_tok_s"] for k, v in ours.items() if k.startswith("C=")}, ours["checks"])  # fmt: skip
    print(f"record: {record}")


if __name__ == "__main__":
    main()
