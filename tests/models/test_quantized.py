"""Quantized checkpoints: FP8 weights load with their scales (block-wise and per-channel),
giving transformers' greedy tokens on the dequantized weights; anything the loader does not
implement is refused at start-up, naming it.

The FP8 checkpoints are made here from a float32 test checkpoint: every decoder-layer linear
weight is quantized to E4M3 with a scale per block (or per row), as Qwen3-*-FP8 stores them;
the oracle is transformers running the same weights dequantized (`fp8 * scale`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from metrale.errors import CheckpointError, InvalidRequestError
from metrale.kernels import reference
from metrale.layers.fp8_linear import Fp8Linear
from metrale.model_engine import fp8_weights
from tests.helpers.checkpoints import DENSE_VARIANTS, build, load_hf
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.parity import (
    assert_matches,
    count_identical_or_near_ties,
    hf_greedy,
    mixed_prompts,
)

QWEN3 = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 weights and `weight_scale_inv` (one scale per block: amax / 448)."""
    bo, bi = block
    rows, cols = w.shape
    scales = torch.empty(-(-rows // bo), -(-cols // bi))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            s = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            scales[i, j] = s
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (tile / s).to(torch.float8_e4m3fn)
    return q, scales


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w / s).to(torch.float8_e4m3fn), s


def fp8_checkpoint(dst: Path, kind: str, block: int = 16) -> tuple[Path, Path]:
    """`(fp8 checkpoint, its dequantized float32 twin)` of the Qwen3 test variant (`block`:
    the side of the square scale blocks of kind "block")."""
    src = build(QWEN3)
    fp8, ref = dst / "fp8", dst / "dequantized"
    for d in (fp8, ref):
        shutil.copytree(src, d)
    (file,) = sorted(fp8.glob("*.safetensors"))
    tensors = load_file(str(file))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in LINEARS:
            w = t.float()
            if kind == "block":
                q, s = quantize_block(w, (block, block))
                quantized[name], quantized[name + "_scale_inv"] = q, s
                full = s.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)
                dequantized[name] = q.float() * full[:, : w.shape[1]]
            else:
                q, s = quantize_channel(w)
                quantized[name], quantized[name + "_scale"] = q, s
                dequantized[name] = q.float() * s
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(file))
    save_file(dequantized, str(sorted(ref.glob("*.safetensors"))[0]))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {
        "block": {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "weight_block_size": [block, block]},
        "channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
        "compressed": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }},
            "ignore": ["lm_head"],
        },
    }[kind]  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


@pytest.mark.parametrize("kind", ["block", "channel", "compressed"])
def test_fp8_checkpoint_gives_transformers_tokens_on_the_dequantized_weights(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fp8, ref = fp8_checkpoint(tmp_path, kind)
    prompts = mixed_prompts(4)
    llm = LLM(str(fp8), device="cpu", dtype="float32", num_kv_blocks=120)
    assert "dequantized at load" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, logprobs=5)
    outs = llm.generate(prompts, params)
    hf = load_hf(ref)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out, hf_greedy(hf, prompt, 16))
    assert_no_leaks(llm.engine)
    # The quantization is real: the dequantized weights differ from the float32 originals.
    original = load_file(str(sorted(build(QWEN3).glob("*.safetensors"))[0]))
    deq = load_file(str(sorted(ref.glob("*.safetensors"))[0]))
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(original[name], deq[name])


def test_unsupported_quantization_is_refused_naming_the_method(tmp_path: Path) -> None:
    path = shutil.copytree(build(QWEN3), tmp_path / "awq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'awq' is not supported"):
        LLM(str(path), device="cpu")


def test_fp8_tensor_without_a_quantization_config_is_refused(tmp_path: Path) -> None:
    fp8, _ = fp8_checkpoint(tmp_path, "block")
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        LLM(str(fp8), device="cpu")


def test_fp8_weight_without_its_scale_is_refused(tmp_path: Path) -> None:
    fp8, _ = fp8_checkpoint(tmp_path, "block")
    (file,) = sorted(fp8.glob("*.safetensors"))
    tensors = load_file(str(file))
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=r"o_proj\.weight' has no scale"):
        LLM(str(fp8), device="cpu")


# -------------------------------------------------------------------------------------------
# FP8 weights kept in FP8 (the CUDA path), run here with the torch reference ops
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_fp8_weights_kept_in_fp8_give_the_dequantized_tokens(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer side of the CUDA path on the CPU: projections become `Fp8Linear` (weights
    and scales as stored, fused q/k/v and gate/up parts in place) and `linear_fp8` (here the
    reference) gives transformers' tokens on the dequantized weights."""
    fp8, ref = fp8_checkpoint(tmp_path, kind)
    real_plan = fp8_weights.plan

    def plan_on_cpu(config, quant, device):  # type: ignore[no-untyped-def]
        return real_plan(config, quant, torch.device("cuda"))

    monkeypatch.setattr(fp8_weights, "plan", plan_on_cpu)
    prompts = mixed_prompts(3)
    llm = LLM(str(fp8), device="cpu", dtype="float32", num_kv_blocks=120)
    module = llm.engine.model.module
    layers = [m for m in module.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * _num_layers(ref)
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert llm.engine.load_report.weight_dtype.startswith("fp8 e4m3")
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=5)
    outs = llm.generate(prompts, params)
    hf = load_hf(ref)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out, hf_greedy(hf, prompt, 12))
    assert_no_leaks(llm.engine)


def test_fused_parts_off_the_block_grid_stay_dequantized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """64x64 blocks: q is 64 rows, k and v 32, so v starts inside a row block and the fused
    qkv cannot hold the parts' block scales. It stays float (dequantized at load, logged);
    o_proj, gate_up and down stay FP8; the tokens are still transformers' on the
    dequantized weights."""
    fp8, ref = fp8_checkpoint(tmp_path, "block", block=64)
    real_plan = fp8_weights.plan
    monkeypatch.setattr(
        fp8_weights,
        "plan",
        lambda config, quant, device: real_plan(config, quant, torch.device("cuda")),
    )
    llm = LLM(str(fp8), device="cpu", dtype="float32", num_kv_blocks=120)
    assert "stay in the model dtype" in caplog.text and "dequantized at load" in caplog.text
    module = llm.engine.model.module
    attn = module.model.layers[0].self_attn
    assert not isinstance(attn.qkv_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    assert isinstance(module.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    prompt = mixed_prompts(1)[0]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=5)
    (out,) = llm.generate([prompt], params)
    assert_matches(out, hf_greedy(load_hf(ref), prompt, 8))


def _num_layers(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])


@pytest.mark.parametrize("block", [None, (16, 16), (128, 128)])
def test_online_fp8_quantizer_round_trip_error_is_bounded(block: tuple[int, int] | None) -> None:
    """`quantize_fp8` then `dequantize_fp8`: each element within E4M3's half-ulp (2^-4
    relative, for normal values) of its block's scale, and the block max exact."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 1, 300)[None, :]
    q, s = reference.quantize_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    back = reference.dequantize_fp8(q, s, block)
    full = s.reshape(-1, 1).expand_as(w) if block is None else (
        s.repeat_interleave(block[0], 0)[:200].repeat_interleave(block[1], 1)[:, :300]
    )  # fmt: skip
    err = (back - w).abs()
    # Relative 2^-4 of the value, or E4M3's smallest subnormal step (2^-9) of the scale.
    bound = torch.maximum(w.abs() * 2.0**-4, full * 2.0**-9) * 1.0001
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # it did quantize
    # Per-row scales: each row's largest magnitude maps to 448 and back exactly.
    if block is None:
        rows = torch.arange(200)
        cols = w.abs().argmax(dim=1)
        torch.testing.assert_close(back[rows, cols], w[rows, cols], rtol=1e-6, atol=0)


@pytest.mark.parametrize("method", ["fp8", "fp8-block"])
def test_online_fp8_is_refused_on_the_cpu(method: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"quantization '{method}' runs on CUDA only"):
        LLM(str(build(QWEN3)), device="cpu", quantization=method)


@pytest.mark.parametrize(
    ("method", "scales"), [("fp8", "per-channel"), ("fp8-block", "block 128x128")]
)
def test_online_fp8_layer_path_tracks_the_float_run(
    monkeypatch: pytest.MonkeyPatch, method: str, scales: str
) -> None:
    """`--quantization fp8`'s load path (projections quantized per row, or per 128x128 block
    with `fp8-block`, after loading, then run through `linear_fp8`, here the reference) on the
    bundled trained model: the weights take fewer bytes, and greedy tokens equal the float32
    run's or first leave them at a near tie."""
    real_plan = fp8_weights.plan
    monkeypatch.setattr(
        fp8_weights,
        "plan",
        lambda config, quant, device: real_plan(config, quant, torch.device("cuda")),
    )
    base = LLM(None, device="cpu", dtype="float32", num_kv_blocks=100)
    fp8 = LLM(None, device="cpu", dtype="float32", num_kv_blocks=100, quantization=method)
    report = fp8.engine.load_report
    assert report.weight_dtype.startswith(f"fp8 e4m3 ({scales} scales, quantized at load")
    assert report.weights_bytes < 0.6 * base.engine.load_report.weights_bytes
    tok = base.get_tokenizer()
    prompts = [tok.encode(t) for t in ("def fibonacci(n):\n", "import os\n\n", "class Stack:\n")]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=5)
    identical = count_identical_or_near_ties(
        base.generate(prompts, params), fp8.generate(prompts, params)
    )
    assert identical >= 2, f"only {identical}/3 identical"


def test_a_misshapen_scale_is_refused_on_the_fp8_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight kept in FP8 has its scale checked as a dequantized one is: a block-scale grid
    of the wrong shape is a start-up error naming the tensor."""
    fp8, _ = fp8_checkpoint(tmp_path, "block")
    (file,) = sorted(fp8.glob("*.safetensors"))
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(file))
    real_plan = fp8_weights.plan
    monkeypatch.setattr(
        fp8_weights,
        "plan",
        lambda config, quant, device: real_plan(config, quant, torch.device("cuda")),
    )
    with pytest.raises(CheckpointError, match=r"down_proj\.weight': block scales have shape"):
        LLM(str(fp8), device="cpu", dtype="float32", num_kv_blocks=40)
