"""The engine's LoRA adapter registry surface: load, list, look up and unload adapters, and
the slot pool's counters (a mixin of `Engine`; the slots themselves are the model's,
`metrale.model_engine.lora`).

Owner: engine. Invariants:
- An adapter is unloaded only while no unfinished request (queued or running) uses it;
  otherwise `unload_lora_adapter` refuses and nothing changes.
- A bad adapter raises at load and changes nothing (the model checks it in full first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metrale.engine.output import RequestState
from metrale.engine.request import LoRARequest
from metrale.errors import InvalidRequestError
from metrale.model_engine.traits import Model
from metrale.scheduler.core import Scheduler


class EngineLora:
    """LoRA adapters of an `Engine` (see the module docstring)."""

    model: Model
    requests: dict[str, RequestState]
    scheduler: Scheduler

    def load_lora_adapter(self, name: str, path: str, adapter_id: int | None = None) -> int:
        """Register the PEFT adapter at `path` as `name` (checked in full first: a bad one
        raises and changes nothing); returns its id, the `adapter_id` of its requests
        (`adapter_id` when given: the server hands ids out so none is reused across engine
        restarts)."""
        return self.model.load_lora(name, path, adapter_id)

    def lora_adapter_list(self) -> list[tuple[str, int, str]]:
        """The registered adapters as (name, id, directory), picklable."""
        return [(e.name, int(e.adapter_id), str(e.path)) for e in self.model.lora_adapters()]

    def unload_lora_adapter(self, name: str) -> int:
        """Forget adapter `name`. Refused (InvalidRequestError) while an unfinished request
        uses it, queued or running: unloading never cuts a request short."""
        entry = self.lora_adapter(name)
        if entry is None:
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded", param="lora_name")
        users = sum(
            1
            for st in self.requests.values()
            if any(c.seq.adapter_id == entry.adapter_id for c in st.choices)
        )
        if users:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} is in use by {users} unfinished request(s); unload it "
                "once they finish",
                param="lora_name",
            )
        return self.model.unload_lora(name)

    def lora_adapter(self, name: str) -> Any:
        """The registered adapter called `name` (`name`, `adapter_id`, `path`), or None."""
        return next((e for e in self.model.lora_adapters() if e.name == name), None)

    def lora_adapter_id(self, request: LoRARequest) -> int:
        """The id of `request`'s adapter, loading it on first use (offline `lora_request`)."""
        entry = self.lora_adapter(request.lora_name)
        if entry is None:
            return self.load_lora_adapter(request.lora_name, request.lora_path)
        if Path(entry.path) != Path(request.lora_path):
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_name!r} is loaded from {entry.path}, not "
                f"{request.lora_path}",
                param="lora_request",
            )
        return int(entry.adapter_id)

    def lora_stats(self) -> dict[str, int]:
        """The slot pool's counters plus the sequences waiting for a slot (empty: no LoRA)."""
        stats = dict(self.model.lora_stats())
        if stats:
            stats["waiting_for_slot"] = self.scheduler.stats.lora_waiting_for_slot
        return stats

    def _check_adapter(self, adapter_id: int) -> None:
        if not any(e.adapter_id == adapter_id for e in self.model.lora_adapters()):
            raise InvalidRequestError(f"LoRA adapter id {adapter_id} is not loaded", param="model")
