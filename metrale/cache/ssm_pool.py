"""The SSM slot pool: per recurrent layer one preallocated conv-state tensor and one SSM-state
tensor, indexed by slot; every live sequence of a hybrid model owns one slot.

Owner: cache (created by the model-engine factory, owned by `TransformerModel`, read and written
in place by the recurrent layers through the slot indices in the batch metadata).

Invariants:
- A pool has at least one slot (a `ValueError` otherwise); the snapshot store, built on a
  pool, relies on this check and makes none of its own.
- Shapes and dtypes are fixed at construction: conv states `[num_slots, *conv_shape]` in the
  model dtype, SSM states `[num_slots, *state_shape]` always float32, whatever the model dtype.
- A slot is free or held by exactly one `SlotGuard`. `SlotGuard.release()` returns it once;
  later calls do nothing. A guard dropped without an explicit release returns its slot too
  (the seed's `Drop`), so no exit path can leak a slot.
- `num_tokens[slot]` is how many tokens of its sequence the slot's state covers; it is reset
  to 0 when the slot is handed out, so a new sequence never reads another one's state.
- Slots are handed out lowest index first, so the same request order gives the same slots.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
from dataclasses import dataclass

import torch

from metrale.errors import KVCacheExhausted

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SsmLayerSpec:
    """Per-slot shapes of one recurrent layer's state."""

    #: Conv window per slot, HF layout `(conv_dim, kernel_size)`: the last `kernel_size` raw
    #: inputs of the causal conv, oldest first.
    conv_shape: tuple[int, ...]
    #: Recurrent state per slot (Mamba-2: `(heads, head_dim, d_state)`; gated delta net:
    #: `(value_heads, key_head_dim, value_head_dim)`).
    state_shape: tuple[int, ...]

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        conv = _numel(self.conv_shape) * torch.empty((), dtype=conv_dtype).element_size()
        return conv + _numel(self.state_shape) * 4


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SlotGuard:
    """Holds one pool slot; returns it to the free list exactly once."""

    __slots__ = ("_idx", "_pool", "token")

    def __init__(self, pool: SsmSlotPool, idx: int) -> None:
        self._pool: SsmSlotPool | None = pool
        self._idx: int | None = idx
        #: Identifies this guard's ownership in the pool without keeping the guard alive.
        self.token = object()

    def idx(self) -> int | None:
        return self._idx

    def release(self) -> None:
        """Return the slot to the pool (idempotent)."""
        pool, idx = self._pool, self._idx
        self._pool = self._idx = None
        if pool is not None and idx is not None:
            pool._release(idx, self)

    def forget(self) -> int | None:
        """Give up ownership without freeing the slot (the seed's `take()` for detach): the
        slot stays allocated, without an owner, until a `compact` moves a survivor into it."""
        pool, idx = self._pool, self._idx
        self._pool = self._idx = None
        if pool is not None and idx is not None:
            pool._orphan(idx, self)
        return idx

    def __del__(self) -> None:  # the seed's Drop: no path leaks a slot
        if self._pool is not None and self._idx is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown
                self.release()

    def __repr__(self) -> str:
        return f"SlotGuard({self._idx})"


class SsmSlotPool:
    def __init__(
        self,
        specs: list[SsmLayerSpec],
        num_slots: int,
        conv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"an SSM slot pool needs at least one slot, got {num_slots}")
        self.specs = list(specs)
        self.num_slots = num_slots
        self.conv_dtype = conv_dtype
        self.device = device
        self.conv_states: list[torch.Tensor] = [
            torch.zeros((num_slots, *s.conv_shape), dtype=conv_dtype, device=device)
            for s in self.specs
        ]
        self.ssm_states: list[torch.Tensor] = [
            torch.zeros((num_slots, *s.state_shape), dtype=torch.float32, device=device)
            for s in self.specs
        ]
        #: Tokens of the owning sequence that each slot's state covers.
        self.num_tokens: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots))
        heapq.heapify(self._free)
        #: slot -> the ownership token of its current guard (None: allocated but detached,
        #: awaiting a compact). Tokens, not guards, so a dropped guard is really dropped.
        self._owner: dict[int, object | None] = {}

    # ------------------------------------------------------------------ accounting

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per recurrent layer, `(conv_states, ssm_states)` pool tensors."""
        return list(zip(self.conv_states, self.ssm_states, strict=True))

    def num_free(self) -> int:
        return len(self._free)

    def num_allocated(self) -> int:
        return len(self._owner)

    def is_free(self, idx: int) -> bool:
        return idx not in self._owner

    def bytes_total(self) -> int:
        return self.num_slots * sum(s.bytes_per_slot(self.conv_dtype) for s in self.specs)

    @staticmethod
    def bytes_for(specs: list[SsmLayerSpec], num_slots: int, conv_dtype: torch.dtype) -> int:
        return num_slots * sum(s.bytes_per_slot(conv_dtype) for s in specs)

    # ------------------------------------------------------------------ slots

    def allocate(self) -> SlotGuard:
        """Take the lowest free slot, its state reset to cover zero tokens."""
        if not self._free:
            raise KVCacheExhausted(
                f"SSM slot pool exhausted: all {self.num_slots} slots hold live sequences"
            )
        idx = heapq.heappop(self._free)
        guard = SlotGuard(self, idx)
        self._owner[idx] = guard.token
        self.num_tokens[idx] = 0
        return guard

    def _release(self, idx: int, guard: SlotGuard) -> None:
        if self._owner.get(idx) is not guard.token:
            return  # the slot was taken over by a compact; this guard no longer owns it
        del self._owner[idx]
        self.num_tokens[idx] = 0
        heapq.heappush(self._free, idx)

    def _orphan(self, idx: int, guard: SlotGuard) -> None:
        if self._owner.get(idx) is guard.token:
            self._owner[idx] = None

    def move(self, guard: SlotGuard, new_idx: int) -> None:
        """Move the state held by `guard` into `new_idx` bit-exactly and make the guard own it.

        `new_idx` is either free, or held by a sequence being retired (the seed's compaction:
        a survivor moves into a retired sequence's slot, which is then detached). A guard that
        held `new_idx` loses it: its release becomes a no-op. The old slot is freed.
        """
        old = guard.idx()
        if old is None or guard._pool is not self:
            raise ValueError("the guard holds no slot of this pool")
        if not 0 <= new_idx < self.num_slots:
            raise ValueError(f"slot {new_idx} is outside the pool of {self.num_slots}")
        if new_idx == old:
            return
        # A guard still naming `new_idx` loses it here (its release becomes a no-op, because
        # `_owner` will name the migrating guard); a free `new_idx` leaves the free list.
        if new_idx not in self._owner:
            self._free.remove(new_idx)
            heapq.heapify(self._free)
        self.copy_slot(old, new_idx)
        self.num_tokens[new_idx] = self.num_tokens[old]
        self._owner[new_idx] = guard.token
        guard._idx = new_idx
        del self._owner[old]
        self.num_tokens[old] = 0
        heapq.heappush(self._free, old)

    # ------------------------------------------------------------------ state data

    def copy_slot(self, src: int, dst: int) -> None:
        for conv, ssm in self.layers:
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])

    def zero_slot(self, idx: int) -> None:
        for conv, ssm in self.layers:
            conv[idx].zero_()
            ssm[idx].zero_()
        self.num_tokens[idx] = 0

    def read_slot(self, idx: int) -> dict[str, object]:
        """Host copies of one slot's state in every layer (for swap-out)."""
        return {
            "conv": [conv[idx].cpu().clone() for conv in self.conv_states],
            "ssm": [ssm[idx].cpu().clone() for ssm in self.ssm_states],
            "num_tokens": self.num_tokens[idx],
        }

    def write_slot(self, idx: int, data: dict[str, object]) -> None:
        """Inverse of `read_slot` (for swap-in)."""
        convs = data["conv"]
        ssms = data["ssm"]
        assert isinstance(convs, list) and isinstance(ssms, list)
        if len(convs) != len(self.conv_states) or len(ssms) != len(self.ssm_states):
            raise ValueError("swap record holds state for a different number of SSM layers")
        for pool, host in zip(self.conv_states, convs, strict=True):
            pool[idx].copy_(host.to(pool.device))
        for pool, host in zip(self.ssm_states, ssms, strict=True):
            pool[idx].copy_(host.to(pool.device))
        tokens = data["num_tokens"]
        assert isinstance(tokens, int)
        self.num_tokens[idx] = tokens
