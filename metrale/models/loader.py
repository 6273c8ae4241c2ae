"""Reading safetensors checkpoints (single file or sharded with an index) into a model's
parameters, with every failure named.

Owner: models. An architecture declares how Hugging Face tensor names map onto its own
parameters (`WeightMapping`); this module does the reading, the shape checks and the
bookkeeping of what was loaded.

Invariants:
- A missing or truncated file, a tensor absent from every file, and a tensor whose shape does
  not match the config each raise `CheckpointError` naming the file and tensor.
- Every parameter of the model is written exactly once (a stacked parameter once per shard);
  anything left unwritten at the end is an error, never left at its initial value.
- Tensors the architecture does not use are counted and logged, not silently dropped.
- A float8 tensor is loaded only through the checkpoint's quantization scheme (its scale
  applied); without one it is an error (`quantization.py`).
- A float8 parameter (an `Fp8Linear`'s weight, with its `weight_scale` beside it) receives
  the checkpoint's FP8 weight and scale as stored, its fused parts' scale rows at
  `offset // block rows`; a float checkpoint tensor for it is quantized on the way
  (`reference.quantize_fp8`). Every other parameter receives float values.
- With a `reader` (a tensor-parallel rank, `metrale.distributed.shard`) only the parts it
  returns are read from the files, under the names it gives; they are shape-checked against
  the rank's parameters like any tensor, and the completeness check is unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from metrale.errors import CheckpointError
from metrale.kernels.reference import quantize_fp8
from metrale.model_config import ModelConfig
from metrale.models.quantization import Fp8Weight, WeightQuant, dequantized
from metrale.progress import LoadProgress, NullProgress

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or every `*.safetensors`."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        files = sorted({root / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {INDEX_FILE} but missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors weight files found")
    return files


#: Reads one tensor (or its part) from an open `safe_open` handle: `(name to load it as,
#: tensor)`, or None to skip it; a tensor-parallel rank's slices (`metrale.distributed`).
TensorReader = Callable[[str, Any], "tuple[str, torch.Tensor] | None"]


def iter_tensors(
    files: list[Path], reader: TensorReader | None = None
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield `(name, tensor, file)` for every tensor, reading one at a time (through `reader`
    when given: only the parts it asks for, under the names it gives)."""
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                try:
                    got = reader(name, f) if reader is not None else (name, f.get_tensor(name))
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(
                        f"{path}: tensor '{name}' cannot be read; the file is truncated or "
                        f"corrupt ({exc})"
                    ) from exc
                if got is not None:
                    yield got[0], got[1], path


@dataclass
class StackedShard:
    """Checkpoint tensor suffix `source` fills rows `[offset, offset + rows)` of `target`."""

    target: str
    source: str
    offset: int
    rows: int


@dataclass
class ExpertShard:
    """Per-expert checkpoint tensors `<prefix>.experts.<e>.<source>.weight` fill rows
    `[offset, offset + rows)` of expert `e` in the stacked 3-D parameter
    `<prefix>.experts.<target>` (`[num_experts, rows_total, cols]`)."""

    target: str
    source: str
    offset: int
    rows: int


@dataclass
class WeightMapping:
    """How checkpoint names become parameter names."""

    #: Fused parameters, e.g. q/k/v into qkv_proj.
    stacked: list[StackedShard] = field(default_factory=list)
    #: Per-expert tensors stacked into one parameter per projection (MoE).
    experts: list[ExpertShard] = field(default_factory=list)
    #: Parameter-name prefixes of optional weight groups (e.g. `mtp.`): a group the checkpoint
    #: lacks entirely is reported by `load_weights` instead of failing; a partial one fails.
    optional_prefixes: tuple[str, ...] = ()
    #: Checkpoint names (suffix match) that are skipped on purpose, with the reason.
    ignored_suffixes: dict[str, str] = field(default_factory=dict)
    #: Optional renaming applied before anything else.
    rename: Callable[[str], str] | None = None


def qkv_shards(cfg: ModelConfig, q_factor: int = 1) -> list[StackedShard]:
    """Separate q/k/v projections into the fused `qkv_proj` (q first, then k, then v), sized
    by the config's heads; `q_factor` 2: each q head carries an output gate (twice the rows)."""
    q_rows = q_factor * cfg.num_attention_heads * cfg.head_dim
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    return [
        StackedShard("qkv_proj", "q_proj", 0, q_rows),
        StackedShard("qkv_proj", "k_proj", q_rows, kv_rows),
        StackedShard("qkv_proj", "v_proj", q_rows + kv_rows, kv_rows),
    ]


def gate_up_shards(intermediate: int) -> list[StackedShard]:
    """Separate gate/up projections into the fused `gate_up_proj` (gate first)."""
    return [
        StackedShard("gate_up_proj", "gate_proj", 0, intermediate),
        StackedShard("gate_up_proj", "up_proj", intermediate, intermediate),
    ]


def rotary_and_tied_ignored(tied: bool) -> dict[str, str]:
    """Checkpoint tensors every rotary decoder may carry and never loads."""
    ignored = {"rotary_emb.inv_freq": "recomputed from the config"}
    if tied:
        ignored["lm_head.weight"] = "tied to the embeddings"
    return ignored


def dense_weight_mapping(cfg: ModelConfig, tied: bool) -> WeightMapping:
    """The mapping of a decoder whose layers hold fused `qkv_proj` and `gate_up_proj` only
    (the dense family, Bamba)."""
    return WeightMapping(
        stacked=qkv_shards(cfg) + gate_up_shards(cfg.intermediate_size),
        ignored_suffixes=rotary_and_tied_ignored(tied),
    )


def load_weights(
    model: torch.nn.Module,
    model_dir: str | Path,
    mapping: WeightMapping,
    *,
    skip_params: set[str] | None = None,
    quant: WeightQuant | None = None,
    progress: LoadProgress | None = None,
    reader: TensorReader | None = None,
) -> set[str]:
    """Copy every checkpoint tensor into `model` (its dtype and device), checking shapes;
    quantized weights (`quant`) arrive dequantized (`quantization.dequantized`).

    Returns the optional prefixes (`mapping.optional_prefixes`) of which no tensor was found;
    the caller drops those parameters. `progress` hears of each tensor's bytes and each
    finished shard. `reader`: a tensor-parallel rank's slices (see `iter_tensors`)."""
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters())
    skip_params = skip_params or set()
    fp8 = fp8_blocks(model)
    pending: dict[str, set[tuple[int, int]] | None] = {
        name: None
        for name in params
        if name not in skip_params and name.removesuffix("_scale") not in fp8
    }
    unused: list[str] = []

    def keep(hf_name: str) -> bool:
        return target_name(hf_name, mapping) in fp8

    stream = dequantized(
        _reported(files, progress or NullProgress(), reader), quant, keep if fp8 else None
    )
    for hf_name, tensor, path in stream:
        name = mapping.rename(hf_name) if mapping.rename else hf_name
        if any(name.endswith(s) for s in mapping.ignored_suffixes):
            continue
        expert = _match_expert(name, mapping.experts)
        if expert is not None:
            target, index, eshard = expert
            if target not in params or params[target].dim() != 3:
                unused.append(hf_name)
                continue
            param = params[target]
            if index >= param.shape[0]:
                raise CheckpointError(
                    f"{path}: tensor '{hf_name}' names expert {index} but the config has "
                    f"{param.shape[0]} experts"
                )
            _check_shape(tensor, (eshard.rows, param.shape[2]), hf_name, path)
            with torch.no_grad():
                param.data[index, eshard.offset : eshard.offset + eshard.rows].copy_(tensor)
            done = pending.get(target) or set()
            done.add((index * param.shape[1] + eshard.offset, eshard.rows))
            pending[target] = done
            continue
        shard = next((s for s in mapping.stacked if _has_part(name, s.source)), None)
        if shard is not None:
            target = _replace_part(name, shard.source, shard.target)
            if target not in params:
                unused.append(hf_name)
                continue
            param = params[target]
            expected = (shard.rows, *param.shape[1:])
            _check_shape(tensor, expected, hf_name, path)
            if target in fp8:
                _write_fp8(params, target, shard.offset, tensor, fp8[target], hf_name, path)
            else:
                with torch.no_grad():
                    param.data[shard.offset : shard.offset + shard.rows].copy_(tensor)
            done = pending.get(target) or set()
            done.add((shard.offset, shard.rows))
            pending[target] = done
            continue
        if name not in params or name in skip_params:
            unused.append(hf_name)
            continue
        param = params[name]
        _check_shape(tensor, tuple(param.shape), hf_name, path)
        if name in fp8:
            _write_fp8(params, name, 0, tensor, fp8[name], hf_name, path)
        else:
            with torch.no_grad():
                param.data.copy_(tensor)
        pending.pop(name, None)
    absent = {
        prefix
        for prefix in mapping.optional_prefixes
        if all(pending.get(n, ()) is None for n in params if n.startswith(prefix))
        and any(n.startswith(prefix) for n in params)
    }
    for prefix in absent:
        for n in [n for n in pending if n.startswith(prefix)]:
            del pending[n]
    _check_complete(pending, params, mapping, files)
    if unused:
        logger.info(
            "ignored %d checkpoint tensors this architecture does not use (e.g. %s)",
            len(unused),
            ", ".join(sorted(unused)[:4]),
        )
    return absent


def fp8_blocks(model: torch.nn.Module) -> dict[str, tuple[int, int] | None]:
    """`{weight parameter name: scale block}` of the model's float8 weights (`Fp8Linear`:
    a `weight` with its `weight_scale` and `block` beside it)."""
    return {
        f"{prefix}.weight" if prefix else "weight": getattr(module, "block", None)
        for prefix, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dtype == torch.float8_e4m3fn
    }


def target_name(hf_name: str, mapping: WeightMapping) -> str | None:
    """The parameter a (non-expert) checkpoint tensor fills, as `load_weights` resolves it."""
    name = mapping.rename(hf_name) if mapping.rename else hf_name
    if any(name.endswith(s) for s in mapping.ignored_suffixes):
        return None
    shard = next((s for s in mapping.stacked if _has_part(name, s.source)), None)
    return _replace_part(name, shard.source, shard.target) if shard is not None else name


def _write_fp8(
    params: dict[str, torch.nn.Parameter],
    target: str,
    offset: int,
    tensor: torch.Tensor | Fp8Weight,
    block: tuple[int, int] | None,
    hf_name: str,
    path: Path,
) -> None:
    """Rows `[offset, offset + rows)` of the float8 parameter `target` and their scales in
    `<target>_scale` (see the invariants)."""
    weight, scale = params[target], params[target + "_scale"]
    rows = tensor.shape[0]
    try:
        if isinstance(tensor, Fp8Weight):
            q, s = tensor.weight, tensor.row_scales(block, rows)
        else:
            q, s = quantize_fp8(tensor.to(weight.device), block)
        r0 = offset if block is None else offset // block[0]
        if block is not None and offset % block[0]:
            raise ValueError(f"its rows start at {offset}, inside a {block[0]}-row block")
        with torch.no_grad():
            weight.data[offset : offset + rows].copy_(q)
            scale.data[r0 : r0 + s.shape[0]].copy_(s)
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: tensor '{hf_name}' cannot fill FP8 '{target}': {exc}"
        ) from exc


def _reported(
    files: list[Path], progress: LoadProgress, reader: TensorReader | None = None
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """`iter_tensors(files)`, telling `progress` of each tensor's bytes (once the caller has
    copied it) and of each finished file."""
    sizes = [f.stat().st_size for f in files]
    progress.begin_weights(len(files), sum(sizes))
    for index, (path, size) in enumerate(zip(files, sizes)):
        for item in iter_tensors([path], reader):
            yield item
            progress.advance(item[1].numel() * item[1].element_size())
        progress.shard_done(index, path, size)
    progress.end_weights()


def _match_expert(name: str, shards: list[ExpertShard]) -> tuple[str, int, ExpertShard] | None:
    """`(target parameter, expert index, shard)` for `<prefix>.experts.<e>.<source>.weight`."""
    if not shards or ".experts." not in name or not name.endswith(".weight"):
        return None
    prefix, _, rest = name.rpartition(".experts.")
    index, _, source = rest.removesuffix(".weight").partition(".")
    if not index.isdigit():
        return None
    for shard in shards:
        if source == shard.source:
            return f"{prefix}.experts.{shard.target}", int(index), shard
    return None


def _has_part(name: str, part: str) -> bool:
    return f".{part}." in f".{name}"


def _replace_part(name: str, part: str, new: str) -> str:
    return f".{name}".replace(f".{part}.", f".{new}.", 1)[1:]


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...], name: str, path: Path) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointError(
            f"{path}: tensor '{name}' has shape {list(tensor.shape)} but the config implies "
            f"{list(expected)}"
        )


def _check_complete(
    pending: dict[str, set[tuple[int, int]] | None],
    params: dict[str, torch.nn.Parameter],
    mapping: WeightMapping,
    files: list[Path],
) -> None:
    missing: list[str] = []
    for name, shards in pending.items():
        if shards is None:
            missing.append(name)
            continue
        covered = sum(rows for _, rows in shards)
        shape = params[name].shape
        if covered != (shape[0] * shape[1] if len(shape) == 3 else shape[0]):
            parts = [s.source for s in mapping.stacked if s.target == name.split(".")[-2]]
            missing.append(f"{name} (parts of {'/'.join(parts) or 'a fused weight'})")
    if missing:
        where = ", ".join(str(f.name) for f in files)
        raise CheckpointError(
            f"missing weights in {where}: {', '.join(sorted(missing)[:6])}"
            + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        )
