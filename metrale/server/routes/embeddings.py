"""OpenAI embeddings route: `POST /v1/embeddings` for the served model.

Owner: server. Each input is one engine request that pools the prompt's final hidden states
(`--pooling`: the last token's, or the mean over every prompt token), L2-normalised, and
generates nothing the client sees (`SamplingParams.pooling`).

Invariants:
- `input` is a string, a list of strings, token ids, or lists of token ids (OpenAI's
  shapes); the answer's `data[i]` is input `i`'s vector, as floats or, with
  `encoding_format: "base64"` (the Python SDK's default), the base64 of its float32
  little-endian bytes.
- `dimensions` other than the model's hidden size is refused with a 400 naming it (the
  model's states are not truncatable embeddings; the size is known once one is computed).
- Embedding requests reuse no cached prefix (every prompt position is computed) and are
  counted in `usage.prompt_tokens`.
- Leaving early (disconnect, error) aborts every engine request of the HTTP request.
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any, ClassVar, Literal

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from metrale.engine.request import RequestOutput
from metrale.errors import InvalidRequestError
from metrale.sampling.params import SamplingParams
from metrale.server.errors import InternalServerError
from metrale.server.protocol.common import SpeculationFields
from metrale.server.routes.common import open_generation, request_body
from metrale.server.streaming import ClientDisconnected, merge_streams, until_disconnected

router = APIRouter()


class EmbeddingRequest(SpeculationFields):
    IGNORED: ClassVar[frozenset[str]] = frozenset({"user"})

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    def check_supported(self) -> None:
        return None


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
async def create_embeddings(request: Request) -> JSONResponse:
    gen = await open_generation(request, EmbeddingRequest)
    state, req = gen.state, gen.body
    if req.dimensions is not None and req.dimensions < 1:
        raise InvalidRequestError("dimensions must be at least 1", param="dimensions")
    prompts = await gen.completion_prompts(req.input)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=state.pooling)
    request_id = f"embd-{uuid.uuid4().hex}"
    streams = await gen.add(request_id, prompts, params, prompt_param="input")
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def collect() -> None:
        merged = merge_streams(streams)
        try:
            async for index, output in merged:
                if output.error is not None:
                    raise InternalServerError(f"embedding failed: {output.error}")
                finals[index] = output
        finally:
            await merged.aclose()

    prompt_tokens = sum(len(ids) for _, ids in prompts)
    try:
        await until_disconnected(request, collect())
    except ClientDisconnected:
        gen.tracker.client_left()
        raise
    finally:
        for stream in streams:
            stream.abort()
        gen.tracker.finish(prompt_tokens, 0, 0, ["stop"] * len(streams))
    data: list[dict[str, Any]] = []
    for i, output in enumerate(finals):
        if output is None or output.embedding is None:
            raise InternalServerError(f"input {i} ended without an embedding")
        if req.dimensions is not None and req.dimensions != len(output.embedding):
            raise InvalidRequestError(
                f"dimensions must be the model's hidden size ({len(output.embedding)}) or "
                f"left out, got {req.dimensions}",
                param="dimensions",
            )
        data.append(
            {"object": "embedding", "index": i,
             "embedding": _encode(output.embedding, req.encoding_format)}
        )  # fmt: skip
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": state.model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
