"""vLLM's runtime LoRA endpoints: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`.

Owner: server. Both need `--enable-lora-runtime-updates` (else 404 saying so) and the API key
(the auth middleware covers every path but `/health` and `/metrics`); they change the engine's
adapter registry through the engine handle's `control` and the server's mirror of it
(`ServerState.loras`), one change at a time.

Invariants:
- A load reads and checks the whole adapter in the engine before it is served: a bad one is a
  400 naming the file and tensor, and nothing changes (requests already running go on).
  A name already served (the base model's included) is a 400.
- An unload of an adapter that an unfinished request uses (queued or running) is refused
  (400 saying how many requests use it); nothing is ever cut short. Once unloaded, requests
  naming it get 404.
- Success answers are plain text, as vLLM's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from metrale.errors import InvalidRequestError, NotFoundError
from metrale.server.errors import safe_text
from metrale.server.state import ServedAdapter, ServerState, read_json, server_state

router = APIRouter()


def _enabled(state: ServerState) -> None:
    if not state.lora_runtime_updates:
        raise NotFoundError(
            "runtime LoRA updates are off; start the server with --enable-lora-runtime-updates"
        )


def _field(body: Any, name: str) -> str:
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    unknown = set(body) - {"lora_name", "lora_path", "load_inplace"}
    if unknown:
        bad = sorted(unknown)[0]
        raise InvalidRequestError(f"unknown field '{safe_text(bad, 256)}'", param=bad)
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"'{name}' must be a non-empty string", param=name)
    return value


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    _enabled(state)
    body = await read_json(request, state.max_body_bytes)
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    if isinstance(body, dict) and body.get("load_inplace"):
        raise InvalidRequestError(
            "load_inplace is not supported: unload the adapter, then load it", param="load_inplace"
        )
    async with state.lora_lock():
        if name == state.model_name or name in (state.loras or {}):
            raise InvalidRequestError(
                f"the model name '{safe_text(name, 256)}' is already served", param="lora_name"
            )
        adapter_id = state.next_adapter_id()
        await state.engine.control("load_lora_adapter", name, path, adapter_id)
        if state.loras is None:
            state.loras = {}
        state.loras[name] = ServedAdapter(name, adapter_id, path, runtime=True)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    _enabled(state)
    body = await read_json(request, state.max_body_bytes)
    name = _field(body, "lora_name")
    async with state.lora_lock():
        if name not in (state.loras or {}):
            raise NotFoundError(
                f"the LoRA adapter '{safe_text(name, 256)}' is not loaded", param="lora_name"
            )
        await state.engine.control("unload_lora_adapter", name)
        assert state.loras is not None
        del state.loras[name]
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
