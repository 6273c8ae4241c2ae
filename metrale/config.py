"""`EngineConfig`: every engine setting in one dataclass, validated in one place. The CLI and
the server derive their flags from its fields.

Owner: engine (read by every layer below it).

Invariants:
- A value out of range raises `InvalidRequestError` naming the field at construction; no
  component re-validates or silently clamps a setting.
- `None` means "derive it": from the checkpoint (max_model_len), the device (dtype, token
  budget) or free memory (KV pool size); `resolve_*` helpers do the deriving.
- Every running sequence can decode each step: a given `max_num_batched_tokens` below
  `max_num_seqs` is refused at construction; a derived one (None: 2048 on the CPU, 8192 on
  CUDA) is raised to `max_num_seqs` by `resolved_batched_tokens`, which the engine logs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from metrale.errors import InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from metrale.spec.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: "auto": K/V stored in the model dtype; "fp8" (alias "fp8_e4m3", vLLM's spelling): float8
#: E4M3 with a K and a V scale per attention layer (`metrale.cache.kv_cache`).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DEVICES = ("auto", "cpu", "cuda")
PREEMPTION_MODES = ("recompute", "swap")
#: "fcfs": queues in arrival order; "priority": by each request's `priority` (lower first,
#: vLLM's rule), then arrival, and preemption takes the lowest priority first.
SCHEDULING_POLICIES = ("fcfs", "priority")
LOAD_FORMATS = ("auto", "dummy")
#: Online weight quantization methods (`quantization`) and the FP8 scale blocks of each:
#: "fp8" one scale per output channel (None), "fp8-block" one per 128 x 128 block (the layout
#: of Qwen3-*-FP8 and DeepSeek checkpoints).
QUANTIZATION_BLOCKS: dict[str, tuple[int, int] | None] = {"fp8": None, "fp8-block": (128, 128)}
QUANTIZATIONS = tuple(QUANTIZATION_BLOCKS)
#: "auto": the checkpoint's generation_config.json supplies default sampling parameters;
#: "none" (or vLLM's spelling "vllm"): the engine's own defaults.
GENERATION_CONFIGS = ("auto", "none", "vllm")


@dataclass
class EngineConfig:
    #: Checkpoint directory; None serves the bundled `metrale-tiny-code`.
    model: str | None = None
    #: Tokenizer directory; None uses the checkpoint's.
    tokenizer: str | None = None
    device: str = "auto"
    #: "auto": float32 on the CPU, bfloat16 on CUDA.
    dtype: str = "auto"
    #: Longest prompt + output; None: the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    max_num_seqs: int = 128
    #: Tokens one forward may carry (decode rows + prefill chunks); None: 2048 CPU, 8192 CUDA.
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    #: Exact KV pool size in blocks (the null block included); None: sized from memory.
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    #: KV memory budget on the CPU, in GiB, when num_kv_blocks is not given.
    cpu_kv_cache_gb: float = 1.0
    #: Torch intra-op threads of the engine on the CPU; None: every core the process may run
    #: on, less one for the HTTP process when the engine serves (`engine.cpu_threads`).
    cpu_threads: int | None = None
    #: One of KV_CACHE_DTYPES: "auto" stores K/V in the model dtype; "fp8" in float8 E4M3
    #: with per-layer scales (checkpoint k_scale/v_scale, else calibrated on the first
    #: prefill), so a KV block takes half the bytes of bfloat16 (a quarter of float32).
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    #: Hybrid (recurrent-state) models: slots of the SSM snapshot store that lets the prefix
    #: cache hit on them (each one full recurrent state, float32); 0 bypasses the prefix cache.
    ssm_snapshot_slots: int = 16
    #: Hybrid models: a prefill capture point (the prompt's tail, a branch point) closer than
    #: this many tokens to a snapshot the prompt already restores is skipped, since each
    #: capture splits the prefill into one more forward. None: 2 blocks on the CPU, 512
    #: tokens on CUDA (hybrids run eagerly there: one forward costs as much as ~800 more
    #: prompt tokens on the Nemotron-H-8B shape, record 20261201T192712).
    ssm_snapshot_min_gap_tokens: int | None = None
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    #: CPU only: projections and attention whose rows never depend on the rest of the batch
    #: or the prompt's chunking (`metrale.kernels.invariant`): byte-identical outputs
    #: whatever ran beside a request, at a speed cost.
    batch_invariant: bool = False
    swap_space_gb: float = 4.0
    #: Preemption swap past `swap_space_gb` goes to files here (None: falls back to recompute),
    #: at most `swap_spill_gb`.
    swap_spill_dir: str | None = None
    swap_spill_gb: float = 0.0
    #: High-speed swap (CPU): each sequence keeps its first block and its newest
    #: `high_speed_swap_blocks_per_seq` blocks in the KV pool; older ones move to host
    #: memory and attention reads them there, so a context is not bounded by the pool.
    high_speed_swap: bool = False
    high_speed_swap_blocks_per_seq: int = 64
    #: Host memory (GiB) keeping KV blocks the prefix cache evicts; 0: none (evicted is gone).
    kv_offload_host_gb: float = 0.0
    #: A directory keeping blocks the host tier evicts, across restarts; None: no disk tier.
    kv_offload_disk: str | None = None
    kv_offload_disk_gb: float = 0.0
    #: Seed of the engine's sampler for unseeded requests.
    seed: int = 0
    served_model_name: str | None = None
    chat_template: str | None = None
    enforce_eager: bool = False
    #: Per-request deadline in seconds (None or 0: none); a request may ask for its own.
    request_timeout: float | None = None
    #: Most requests waiting for admission; more are refused with QueueFullError.
    max_queue: int = 4096
    load_format: str = "auto"
    #: "fp8": quantize a float checkpoint's attention and MLP projections to FP8 (E4M3, one
    #: scale per output channel) at load and run them with the FP8 kernels (CUDA only; an
    #: FP8 checkpoint needs no flag). None: weights as the checkpoint stores them.
    quantization: str | None = None
    #: "auto": requests that leave temperature, top_p, top_k, min_p or repetition_penalty
    #: unset get the checkpoint's generation_config.json values; "none": the engine's defaults.
    generation_config: str = "auto"
    #: Launch a plain decode step while the previous one is still on the device, its input
    #: tokens read there (the device token feed), so host work hides behind the forward.
    async_scheduling: bool = True
    #: Speculative decoding, in vLLM's shape: a dict or its JSON text, e.g.
    #: `{"method": "ngram", "num_speculative_tokens": 4}` (see `metrale.spec.config`);
    #: None: off.
    speculative_config: str | dict[str, Any] | None = None
    #: Serve LoRA adapters (implied by `lora_modules`): allocates the device slots even when
    #: no adapter is given at start-up (adapters come later, offline or at run time).
    enable_lora: bool = False
    #: Adapters served from start-up, each `name=DIR` (a PEFT adapter directory).
    lora_modules: list[str] | None = None
    #: Device slots: adapters whose rows can share one forward.
    max_loras: int = 4
    #: Highest adapter rank a slot holds.
    max_lora_rank: int = 64
    #: Adapters whose weights stay in host memory between promotions; None: 2 x max_loras.
    max_cpu_loras: int | None = None
    #: Vision models: most images in one request, and per image its encoded bytes and decoded
    #: pixels (width x height); over a limit is a 400 naming it.
    max_images_per_request: int = 16
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    #: Comma-separated host names the server may fetch http(s) image URLs from (a host and
    #: its subdomains); None: remote URLs are refused, only data: URLs are read.
    allowed_media_domains: str | None = None
    #: Vision models: a video (a GIF, or a list of frames) is sampled at / taken as this many
    #: frames per second, and may have at most `max_video_frames` frames.
    video_fps: float = 2.0
    max_video_frames: int = 64
    #: Ranks the model is sharded over (tensor parallelism, `metrale.distributed`): one
    #: process per rank, rank 0 the engine's, the others spawned on this host; 1: off.
    tensor_parallel_size: int = 1
    #: With tensor_parallel_size > 1 on an MoE model: place whole experts on each rank
    #: instead of slicing every expert's width.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(field: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid engine setting {field}: {why}", param=field)

        if self.device not in DEVICES:
            raise bad("device", f"'{self.device}' is not one of {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"'{self.dtype}' is not one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad(
                "kv_cache_dtype",
                f"'{self.kv_cache_dtype}' is not one of {', '.join(KV_CACHE_DTYPES)}",
            )
        if self.kv_cache_dtype != "auto" and self.batch_invariant:
            raise bad(
                "kv_cache_dtype",
                "fp8 KV is not supported by the batch-invariant CPU kernels (their attention "
                "reads the model dtype); use kv_cache_dtype auto with batch_invariant",
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise bad("enable_expert_parallel", "needs tensor_parallel_size >= 2")
        if self.video_fps <= 0:
            raise bad("video_fps", f"must be > 0, got {self.video_fps}")
        for name in (
            "max_images_per_request",
            "max_image_bytes",
            "max_image_pixels",
            "max_video_frames",
        ):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if (
            self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise bad(
                "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}) so every running sequence can "
                f"decode each step, got {self.max_num_batched_tokens}",
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise bad("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise bad(
                "num_kv_blocks", f"must be >= 2 (one is the null block), got {self.num_kv_blocks}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gb <= 0:
            raise bad("cpu_kv_cache_gb", f"must be > 0, got {self.cpu_kv_cache_gb}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise bad("cpu_threads", f"must be >= 1, got {self.cpu_threads}")
        if self.ssm_snapshot_min_gap_tokens is not None and self.ssm_snapshot_min_gap_tokens < 0:
            raise bad("ssm_snapshot_min_gap_tokens", "must be >= 0")
        if self.ssm_snapshot_slots < 0:
            raise bad("ssm_snapshot_slots", f"must be >= 0, got {self.ssm_snapshot_slots}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise bad(
                "preemption_mode", f"'{self.preemption_mode}' is not one of {PREEMPTION_MODES}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise bad(
                "scheduling_policy",
                f"'{self.scheduling_policy}' is not one of {SCHEDULING_POLICIES}",
            )
        if self.kv_offload_host_gb < 0 or self.kv_offload_disk_gb < 0:
            raise bad("kv_offload_host_gb", "the KV offload tiers' sizes must be >= 0")
        if self.kv_offload_disk is not None and self.kv_offload_disk_gb <= 0:
            raise bad("kv_offload_disk_gb", "a disk tier (kv_offload_disk) needs a size > 0")
        if self.swap_spill_dir is not None and self.swap_spill_gb <= 0:
            raise bad("swap_spill_gb", "a swap spill directory (swap_spill_dir) needs a size > 0")
        if self.swap_space_gb < 0:
            raise bad("swap_space_gb", f"must be >= 0, got {self.swap_space_gb}")
        if self.request_timeout is not None and self.request_timeout < 0:
            raise bad("request_timeout", f"must be >= 0, got {self.request_timeout}")
        if self.max_queue < 1:
            raise bad("max_queue", f"must be >= 1, got {self.max_queue}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"'{self.load_format}' is not one of {LOAD_FORMATS}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad(
                "quantization", f"'{self.quantization}' is not one of {QUANTIZATIONS} (or unset)"
            )
        self.speculative()  # parses it: a bad key or value fails here, naming it
        self.lora_module_dirs()  # each entry is name=DIR, names unique
        if self.max_loras < 1:
            raise bad("max_loras", f"must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise bad("max_lora_rank", f"must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise bad("max_cpu_loras", f"must be >= 1, got {self.max_cpu_loras}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise bad(
                "generation_config",
                f"'{self.generation_config}' is not one of {', '.join(GENERATION_CONFIGS)}",
            )

    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed and validated (None when off)."""
        spec = self.speculative_config
        if spec is None or spec == "":
            return None
        from metrale.spec.config import SpeculativeConfig

        if isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            return SpeculativeConfig.from_json(spec)
        if isinstance(spec, dict):
            return SpeculativeConfig.from_dict(spec)
        raise InvalidRequestError(
            "invalid engine setting speculative_config: expected a dict or its JSON text, got "
            f"{type(spec).__name__}",
            param="speculative_config",
        )

    def lora_module_dirs(self) -> dict[str, str]:
        """`lora_modules` parsed: adapter name -> directory, in the order given."""
        out: dict[str, str] = {}
        for item in self.lora_modules or []:
            name, sep, path = str(item).partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path:
                raise InvalidRequestError(
                    f"invalid engine setting lora_modules: {item!r} is not name=DIR",
                    param="lora_modules",
                )
            if name in out:
                raise InvalidRequestError(
                    f"invalid engine setting lora_modules: adapter name {name!r} given twice",
                    param="lora_modules",
                )
            out[name] = path
        return out

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine allocates LoRA slots."""
        return self.enable_lora or bool(self.lora_modules)

    @property
    def resolved_max_cpu_loras(self) -> int:
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return 2 * self.max_loras

    @property
    def uses_generation_config(self) -> bool:
        """True when the checkpoint's generation_config.json supplies sampling defaults."""
        return self.generation_config == "auto"

    @staticmethod
    def default_batched_tokens(device_type: str) -> int:
        """The token budget derived from the device alone: 8192 on CUDA, 2048 elsewhere."""
        return 8192 if device_type == "cuda" else 2048

    def resolved_batched_tokens(self, device_type: str) -> int:
        """The token budget: as given, or the device default raised to `max_num_seqs`."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(self.default_batched_tokens(device_type), self.max_num_seqs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def replace(self, **changes: Any) -> EngineConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngineConfig(**values)
