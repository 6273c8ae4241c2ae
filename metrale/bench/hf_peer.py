"""The peer measured in the same run: Hugging Face transformers `generate` on the same model
shape, dtype and batch, with random weights.

Owner: bench.

Invariants:
- The peer's configuration is recorded with its figures (`static_cache`, `compiled`); the best
  configuration that runs is used: static cache + torch.compile when asked and it works, the
  default otherwise, and the fallback reason is recorded.
- Timing excludes model construction and a warm-up generate.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _build(config_dir: str | Path, dtype: torch.dtype, device: torch.device) -> Any:
    import transformers

    raw = json.loads((Path(config_dir) / "config.json").read_text())
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.uniform_(-0.02, 0.02)
    return model.eval()


def _compiled_forward(forward: Any, mode: str) -> Any:
    compiled = torch.compile(forward, mode=mode)
    if mode != "reduce-overhead":
        return compiled

    def step(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return step


def hf_generate_tok_s(
    config_dir: str | Path,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    try_compile: bool = False,
    compile_modes: tuple[str, ...] = ("default",),
) -> dict[str, Any]:
    """Output tokens per second of `generate(do_sample=False)` on `batch` random prompts."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    model = _build(config_dir, dtype, dev)
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab - 10, (batch, prompt_len), device=dev)
    mask = torch.ones_like(ids)
    kwargs: dict[str, Any] = dict(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, attention_mask=mask,
        pad_token_id=0,
    )  # fmt: skip
    info: dict[str, Any] = {"static_cache": False, "compiled": False}
    if try_compile:
        # Static cache + torch.compile in each of `compile_modes` until one runs. With
        # "reduce-overhead" (CUDA graphs) each forward is marked as a new graph step, as torch
        # asks when a static cache is updated in place; on the H200 image (torch 2.11,
        # transformers 5.17) that mode still crashed the process, so it is not the default.
        failures = []
        for mode in compile_modes:
            try:
                model.generation_config.cache_implementation = "static"
                model.forward = _compiled_forward(model.forward, mode)
                with torch.no_grad():  # compile and capture at the timed run's exact shapes
                    for _ in range(2):
                        model.generate(ids, **kwargs)
                info.update(static_cache=True, compiled=True, compile_mode=mode)
                break
            except Exception as exc:  # the peer's best config may not run on this image
                logger.warning("HF static cache + compile (%s) failed: %s", mode, exc)
                failures.append(f"{mode}: {type(exc).__name__}: {exc}"[:300])
                model = _build(config_dir, dtype, dev)
        if failures:
            info["compile_failures"] = failures
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - prompt_len) * batch
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "tok_s": produced / elapsed,
        "seconds": elapsed,
        **info,
    }
