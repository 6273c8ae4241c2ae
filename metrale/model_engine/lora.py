"""Multi-LoRA serving in the model engine: the registry of adapters the engine knows, the host
cache, and the device slot pool with promotion and LRU eviction (reading a PEFT adapter and
checking it against the model is `lora_peft.py`'s).

Owner: model-engine. `TransformerModel` implements the seed's `ModelAdapters` through one
`LoraManager`; the scheduler reaches it only through that interface (`resolve_adapter_slot`,
`acquire_adapter_slot`, `release_adapter_slot`).

Invariants:
- An adapter is read and checked in full (config, every tensor's name, rank and shape against
  the base model) before anything the engine serves changes: a bad adapter raises
  `LoraAdapterError` naming the file and the tensor, and the registry, the host cache and the
  slots are as they were.
- Adapter ids are handed out from 1 upwards and never reused (an id given by the caller must
  be one this registry never used, and moves the counter past it), so a reloaded adapter (new weights under an old name) never shares
  prefix-cache blocks with its predecessor; id 0 is the base model.
- A device slot holds at most one adapter; its ref count is the number of live sequences
  that acquired it. Only a slot with no refs is evicted (least recently used first), and an
  adapter is unregistered only while no slot ref is held on it.
- The host cache holds at most `max_cpu_loras` adapters' weights (LRU); an adapter missing
  from it is read from its directory again when promoted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from metrale.kernels import KernelOps
from metrale.layers.common import GatedMLP, PagedSelfAttention
from metrale.layers.lora import LoraSlots
from metrale.model_engine.lora_peft import (
    LoraAdapterError,
    PeftAdapter,
    adaptable_shapes,
    main_layers,
    read_peft_adapter,
)

logger = logging.getLogger(__name__)


def attach_slots(module: nn.Module, slots: LoraSlots) -> None:
    """Give each main decoder layer's attention and MLP blocks their view of `slots`."""
    for layer_idx, layer in enumerate(main_layers(module)):
        view = slots.layer(layer_idx)
        for block in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
            if isinstance(block, PagedSelfAttention | GatedMLP):
                block.lora = view


@dataclass
class AdapterEntry:
    """A registered adapter: its name, id and directory."""

    name: str
    adapter_id: int
    path: str


@dataclass
class LoraStats:
    """Counters of the slot pool (metrics)."""

    promotions: int = 0
    evictions: int = 0
    disk_loads: int = 0


@dataclass
class _Slot:
    adapter_id: int = 0
    refs: int = 0
    last_used: int = 0


@dataclass
class LoraManager:
    """The adapters an engine serves: registry, host cache and device slots."""

    slots: LoraSlots
    max_cpu_loras: int
    dtype: torch.dtype
    entries: dict[str, AdapterEntry] = field(default_factory=dict)
    stats: LoraStats = field(default_factory=LoraStats)

    def __post_init__(self) -> None:
        self._by_id: dict[int, AdapterEntry] = {}
        self._host: OrderedDict[int, PeftAdapter] = OrderedDict()
        self._pool = [_Slot() for _ in range(self.slots.num_slots)]
        self._next_id = 1
        #: Every id this registry has handed out or accepted (never handed out again).
        self._used_ids: set[int] = set()
        self._clock = 0

    # ------------------------------------------------------------------ registry

    def register(self, name: str, path: str, adapter_id: int | None = None) -> AdapterEntry:
        """Read, check and register the adapter at `path` as `name` (under `adapter_id` when
        given: a caller replaying ids it handed out, which must be unused); raises (changing
        nothing) on a bad adapter or a name or id already registered."""
        if adapter_id is not None and (adapter_id < 1 or adapter_id in self._used_ids):
            raise LoraAdapterError(
                f"LoRA adapter id {adapter_id} was already used or is invalid",
                param="lora_int_id",
            )
        if not name or any(c.isspace() for c in name) or "=" in name:
            raise LoraAdapterError(f"invalid LoRA adapter name {name!r}", param="lora_name")
        if name in self.entries:
            raise LoraAdapterError(
                f"LoRA adapter {name!r} is already loaded (from {self.entries[name].path})",
                param="lora_name",
            )
        adapter = read_peft_adapter(name, path, self.slots.shapes, self.slots.max_rank, self.dtype)
        entry = AdapterEntry(name, adapter_id or self._next_id, str(Path(path)))
        self._next_id = max(self._next_id, entry.adapter_id) + 1
        self._used_ids.add(entry.adapter_id)
        self.entries[name] = entry
        self._by_id[entry.adapter_id] = entry
        self._cache_host(entry.adapter_id, adapter)
        logger.info(
            "LoRA adapter %s (id %d, rank %d, %d projections) registered from %s",
            name, entry.adapter_id, adapter.rank, len(adapter.weights), path,
        )  # fmt: skip
        return entry

    def unregister(self, name: str) -> AdapterEntry:
        """Forget adapter `name`; refused while a sequence holds its slot."""
        entry = self.entries.get(name)
        if entry is None:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded", param="lora_name")
        for i, slot in enumerate(self._pool):
            if slot.adapter_id == entry.adapter_id:
                if slot.refs:
                    raise LoraAdapterError(
                        f"LoRA adapter {name!r} is in use by {slot.refs} running sequence(s)",
                        param="lora_name",
                    )
                self.slots.clear_slot(i)
                self._pool[i] = _Slot()
        self._host.pop(entry.adapter_id, None)
        del self.entries[name]
        del self._by_id[entry.adapter_id]
        logger.info("LoRA adapter %s (id %d) unloaded", name, entry.adapter_id)
        return entry

    def entry_by_id(self, adapter_id: int) -> AdapterEntry | None:
        return self._by_id.get(adapter_id)

    # ------------------------------------------------------------------ slots

    def slot_of(self, adapter_id: int) -> int | None:
        for i, slot in enumerate(self._pool):
            if slot.adapter_id == adapter_id:
                return i
        return None

    def resident(self) -> int:
        return sum(1 for s in self._pool if s.adapter_id)

    def refs(self, slot: int) -> int:
        return self._pool[slot].refs

    def resolve(self, adapter_id: int) -> int | None:
        """The slot holding `adapter_id`, promoting it into a free or the least recently
        used idle slot when it is not resident; None when every slot is in use."""
        entry = self._by_id.get(adapter_id)
        if entry is None:
            raise LoraAdapterError(f"LoRA adapter id {adapter_id} is not loaded", param="model")
        self._clock += 1
        slot = self.slot_of(adapter_id)
        if slot is not None:
            self._pool[slot].last_used = self._clock
            return slot
        idle = [i for i, s in enumerate(self._pool) if s.refs == 0]
        if not idle:
            return None
        victim = min(idle, key=lambda i: (self._pool[i].adapter_id != 0, self._pool[i].last_used))
        self.promote(entry, victim)
        return victim

    def promote(self, entry: AdapterEntry, slot: int) -> str | None:
        """Install `entry` into idle `slot` (from the host cache, else from disk); returns the
        name of the adapter it evicted, if any."""
        current = self._pool[slot]
        if current.refs:
            raise RuntimeError(f"LoRA slot {slot} is in use; it cannot be overwritten")
        adapter = self._host.get(entry.adapter_id)
        if adapter is None:
            adapter = read_peft_adapter(
                entry.name, entry.path, self.slots.shapes, self.slots.max_rank, self.dtype
            )
            self.stats.disk_loads += 1
        self._cache_host(entry.adapter_id, adapter)
        evicted = self._by_id.get(current.adapter_id) if current.adapter_id else None
        self.slots.write_slot(slot, adapter.weights)
        self._pool[slot] = _Slot(adapter_id=entry.adapter_id, last_used=self._clock)
        self.stats.promotions += 1
        if evicted is not None:
            self.stats.evictions += 1
            logger.info("LoRA slot %d: %s evicted for %s", slot, evicted.name, entry.name)
        return evicted.name if evicted is not None else None

    def acquire(self, slot: int) -> int:
        state = self._pool[slot]
        if not state.adapter_id:
            raise RuntimeError(f"LoRA slot {slot} holds no adapter")
        state.refs += 1
        self._clock += 1
        state.last_used = self._clock
        return slot

    def release(self, slot: int) -> None:
        state = self._pool[slot]
        if state.refs <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        state.refs -= 1

    def _cache_host(self, adapter_id: int, adapter: PeftAdapter) -> None:
        self._host[adapter_id] = adapter
        self._host.move_to_end(adapter_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)


class LoraAdapters:
    """The `ModelAdapters` capability of a model that serves LoRA adapters (a mixin of
    `TransformerModel`; `lora` is None when the engine serves none, and every method then
    keeps the seed's base-model-only behaviour)."""

    lora: LoraManager | None = None

    def enable_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        """Allocate `max_loras` device slots of rank up to `max_lora_rank` and attach them
        to the architecture module's layers."""
        module: nn.Module = self.module  # type: ignore[attr-defined]
        shapes = adaptable_shapes(module)
        if not shapes:
            raise LoraAdapterError(
                f"{type(module).__name__} has no projection a LoRA adapter can target"
            )
        device: torch.device = self.device  # type: ignore[attr-defined]
        dtype: torch.dtype = self.dtype  # type: ignore[attr-defined]
        ops = getattr(self, "kernel_ops", None) or KernelOps()
        gather = ops.implementations.get("lora_gather_add", "torch")
        tiled = ops.implementations.get("lora_tiles_add", "torch").startswith("triton")
        planned = tiled and ops.implementations.get("lora_plan", "torch").startswith("triton")
        folded = ops.implementations.get("lora_linear", "torch").startswith("triton")
        slots = LoraSlots(
            shapes, max_loras, max_lora_rank, dtype, device, gather_op=ops.lora_gather_add,
            tiles_op=ops.lora_tiles_add if tiled else None,
            plan_op=ops.lora_plan if planned else None,
            linear_op=ops.lora_linear if folded else None,
        )  # fmt: skip
        attach_slots(module, slots)
        self.lora = LoraManager(slots, max_cpu_loras, dtype)
        logger.info(
            "LoRA: %d device slots of rank <= %d over %d projections (%.1f MiB), host cache "
            "of %d adapters; decode-graph op: %s%s%s; eager forwards: %s",
            max_loras, max_lora_rank, len(shapes), slots.nbytes() / 2**20, max_cpu_loras,
            gather, f", rows grouped by slot from {slots.plan_min_rows} rows" if planned else "",
            ", below that each projection with its deltas in one op (lora_linear)" if folded else "",
            "tiled (triton)" if tiled else "segment GEMMs per slot (torch)",
        )  # fmt: skip

    def _lora(self) -> LoraManager:
        if self.lora is None:
            raise LoraAdapterError(
                "LoRA adapters are not enabled on this engine (start it with --lora-modules, "
                "--enable-lora or --enable-lora-runtime-updates)",
                param="lora",
            )
        return self.lora

    # The engine's side: the registry.
    def load_lora(self, name: str, path: str, adapter_id: int | None = None) -> int:
        """Register the adapter at `path` as `name`; its id (prefix-cache namespace)."""
        return self._lora().register(name, path, adapter_id).adapter_id

    def unload_lora(self, name: str) -> int:
        return self._lora().unregister(name).adapter_id

    def lora_adapters(self) -> list[AdapterEntry]:
        return list(self.lora.entries.values()) if self.lora is not None else []

    def lora_stats(self) -> dict[str, int]:
        if self.lora is None:
            return {}
        st = self.lora.stats
        return {
            "slots": self.lora.slots.num_slots,
            "resident": self.lora.resident(),
            "registered": len(self.lora.entries),
            "promotions": st.promotions,
            "evictions": st.evictions,
            "disk_loads": st.disk_loads,
        }

    # The seed's `ModelAdapters`.
    def adapter_id_for(self, slot: int) -> int:
        if self.lora is None or slot < 0:
            return 0
        return self.lora._pool[slot].adapter_id

    def resolve_adapter_slot(self, adapter_id: int) -> int | None:
        if adapter_id == 0:
            return -1
        return self._lora().resolve(adapter_id)

    def acquire_adapter_slot(self, slot: int) -> int:
        if slot < 0:
            return -1
        return self._lora().acquire(slot)

    def release_adapter_slot(self, resolved: int) -> None:
        if resolved >= 0:
            self._lora().release(resolved)

    def swap_lora_from_disk(self, path: str, name: str, slot: int) -> None:
        manager = self._lora()
        entry = manager.entries.get(name) or manager.register(name, path)
        if not 0 <= slot < manager.slots.num_slots:
            raise LoraAdapterError(f"LoRA slot {slot} is not one of {manager.slots.num_slots}")
        manager.promote(entry, slot)

    def promote_lora_from_disk(self, path: str, name: str) -> tuple[int, str | None]:
        manager = self._lora()
        entry = manager.entries.get(name) or manager.register(name, path)
        resident = manager.slot_of(entry.adapter_id)
        if resident is not None:
            return resident, None
        before = {i: manager._pool[i].adapter_id for i in range(manager.slots.num_slots)}
        slot = manager.resolve(entry.adapter_id)
        if slot is None:
            raise LoraAdapterError(f"every LoRA slot is in use; {name!r} cannot be promoted")
        old = manager.entry_by_id(before[slot]) if before[slot] else None
        return slot, (old.name if old is not None else None)


def lora_slot_bytes(module: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes `enable_lora` will allocate for `module`'s slots."""
    per = sum(fan_in + fan_out for fan_in, fan_out in adaptable_shapes(module).values())
    return per * max_loras * max_rank * torch.empty((), dtype=dtype).element_size()
