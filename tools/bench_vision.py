"""Images per second and time to first token of one-image prompts, metrale against transformers
in the same run, on a Qwen2.5-VL-shaped random checkpoint (`--load-format dummy`).

Usage (GPU): PYTHONPATH=. python3 tools/bench_vision.py bench/configs/qwen2.5-vl-7b \
    --image 448x448 --concurrency 1,16 [--out DIR]
CPU smoke run: add `--device cpu --dtype float32` with a small config directory.

Each level submits C prompts at once (text, one image of distinct random pixels so neither the
encoder cache nor the prefix cache helps, text), each asking for one token: TTFT is each
request's arrival-to-first-token time (median, p90), images per second C / the level's wall
time. transformers runs the same prompts as one batch of C (`generate`, one new token) from
random weights of the same shape; its TTFT is that batch's time. Records land in `--out`
(default `bench/records/`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metrale import Engine, EngineConfig, SamplingParams
from metrale.bench.record import write_record
from metrale.bench.synthetic import prepare_model_dir
from metrale.engine.vision import VisionPrompts


def image(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def prompt(vision: VisionPrompts, width: int, height: int, seed: int) -> tuple[list[int], Any]:
    cfg = vision.config
    rng = np.random.default_rng(10_000 + seed)
    text = [int(t) for t in rng.integers(10, 500, 48)]  # valid ids in any vocabulary here
    ids = [*text[:32], cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id]
    ids += text[32:]
    return vision.build(ids, [image(width, height, seed)])


def run_metrale(engine: Engine, width: int, height: int, c: int, seed: int) -> dict[str, float]:
    assert engine.vision is not None
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    work = [prompt(engine.vision, width, height, seed + i) for i in range(c)]
    start = time.perf_counter()
    for i, (ids, vision) in enumerate(work):
        engine.add_request(f"r{seed}-{i}", None, params, prompt_token_ids=ids, vision=vision)
    ttfts: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ttfts.append(out.metrics.get("ttft", time.perf_counter() - start))
    wall = time.perf_counter() - start
    ttfts.sort()
    return {
        "prompt_tokens": len(work[0][0]),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "wall_s": wall,
        "images_per_s": c / wall,
    }


def run_hf(
    model: Any, engine: Engine, width: int, height: int, c: int, seed: int
) -> dict[str, float]:
    assert engine.vision is not None
    cfg = engine.vision.config
    work = [prompt(engine.vision, width, height, seed + i) for i in range(c)]
    ids = torch.tensor([w[0] for w in work], device=model.device)
    pixels = torch.from_numpy(np.concatenate([w[1].items[0].pixel_values for w in work]))
    grids = torch.tensor([w[1].items[0].grid for w in work])
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
            pixel_values=pixels.to(model.device, model.dtype), image_grid_thw=grids.to(model.device),
            mm_token_type_ids=(ids == cfg.image_token_id).int(),
        )  # fmt: skip
    sync()
    wall = time.perf_counter() - start
    return {"ttft_s": wall, "wall_s": wall, "images_per_s": c / wall}


def hf_model(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config_dir")
    ap.add_argument("--image", default="448x448", help="WIDTHxHEIGHT of every image")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--out", default="bench/records")
    args = ap.parse_args()
    width, height = (int(v) for v in args.image.split("x"))
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = prepare_model_dir(args.config_dir)
    config = EngineConfig(
        model=str(model_dir), device=args.device, dtype=args.dtype, load_format="dummy",
        max_model_len=args.max_model_len, max_num_seqs=max(levels),
        max_num_batched_tokens=max(8192, max(levels) * 512), enable_prefix_caching=True,
    )  # fmt: skip
    engine = Engine(config)
    run_metrale(engine, width, height, 2, seed=99)  # warm-up
    record: dict[str, Any] = {
        "instrument": "vision", "config_dir": args.config_dir, "image": [width, height],
        "device": str(engine.model.device_name()), "dtype": args.dtype, "levels": {},
    }  # fmt: skip
    for c in levels:
        record["levels"][str(c)] = {"metrale": run_metrale(engine, width, height, c, seed=1000 * c)}
    record["metrale_vision_stats"] = dict(engine.model.vision_stats)
    if not args.no_peer:
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
        torch_dtype = getattr(torch, args.dtype)
        peer = hf_model(model_dir, torch_dtype, args.device)
        vision = VisionPrompts(model_dir, _vision_config(model_dir))
        holder = _Holder(vision)
        run_hf(peer, holder, width, height, 2, seed=99)  # type: ignore[arg-type]
        for c in levels:
            record["levels"][str(c)]["transformers"] = run_hf(
                peer,
                holder,
                width,
                height,
                c,
                seed=1000 * c,  # type: ignore[arg-type]
            )
    levels_out = record.pop("levels")
    figures = {c: level["metrale"] for c, level in levels_out.items()}
    figures["vision_stats"] = record.pop("metrale_vision_stats")
    peers = {c: level["transformers"] for c, level in levels_out.items() if "transformers" in level}
    path = write_record(
        "vision", model_shape=Path(args.config_dir).name, config=record, figures=figures,
        peer_figures=peers or None, device=args.device, out_dir=args.out,
        notes="peer: transformers generate (one new token) on the same random weights, one batch of C",
    )  # fmt: skip
    print(json.dumps({"figures": figures, "peer_figures": peers}, indent=2))
    print(f"record: {path}")


class _Holder:
    """What `run_hf` reads of an engine: its `vision` prompts."""

    def __init__(self, vision: VisionPrompts) -> None:
        self.vision = vision


def _vision_config(model_dir: Path) -> Any:
    from metrale.models.config import read_config_json
    from metrale.models.qwen_vl_vision import parse_vision_config

    return parse_vision_config(read_config_json(model_dir))


if __name__ == "__main__":
    main()
