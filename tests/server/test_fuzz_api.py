"""Issue 24 CI gate: a bounded property-based fuzzer of the HTTP API over the app's own
`/openapi.json`: request bodies drawn (hypothesis strategies built from the JSON Schema) from
each POST route's schema,
with and without unknown fields, plus mangled JSON bytes and odd model ids; no answer may be a
5xx, every error has the OpenAI (or Anthropic) shape, and the server stays healthy.

Bounded: a fixed number of derandomized examples per route, and a 0.5 s request deadline in
the engine so no drawn `max_tokens` / `n` can make one example slow."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine
from metrale.engine.engine import Engine
from metrale.server.app import create_app

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def app(checkpoint: Path) -> Iterator[Any]:
    config = EngineConfig(
        model=str(checkpoint), device="cpu", num_kv_blocks=96, max_num_seqs=8,
        request_timeout=0.5,
    )  # fmt: skip
    handle = AsyncEngine(Engine(config))
    handle.start()
    try:
        yield create_app(handle)
    finally:
        handle.shutdown()


def send(app: Any, method: str, path: str, content: bytes | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            headers = {"content-type": "application/json"}
            return await c.request(method, path, content=content, headers=headers, timeout=30)

    return asyncio.run(asyncio.wait_for(go(), 30))


def check(reply: httpx.Response, path: str) -> None:
    assert reply.status_code < 500, (path, reply.status_code, reply.text[:500])
    if reply.status_code >= 400 and reply.content:
        body = reply.json()
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        if path.startswith("/v1/messages"):
            assert body["type"] == "error"
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        for line in reply.text.splitlines():  # an error frame would mean a failure mid-stream
            if line.startswith("data: {"):
                frame = json.loads(line[6:])
                assert "error" not in frame or frame["error"].get("type") not in (
                    "internal_error",
                ), frame


def body_schemas(app: Any) -> dict[str, dict[str, Any]]:
    spec = send(app, "GET", "/openapi.json").json()
    schemas = {}
    for path, item in spec["paths"].items():
        post = item.get("post")
        if post and "requestBody" in post:
            schemas[path] = post["requestBody"]["content"]["application/json"]["schema"]
    return schemas


JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(allow_nan=False),
    st.text(max_size=20),
)  # fmt: skip
ANY_JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of the JSON Schema subset pydantic writes (types, anyOf, enum/const, bounds,
    properties); where it says nothing (`Any` fields), any small JSON value; and, one draw in
    eight, any JSON value whatever the schema says (the wrong types)."""
    return st.one_of(_conforming(schema), _conforming(schema), _conforming(schema),
                     _conforming(schema), _conforming(schema), _conforming(schema),
                     _conforming(schema), ANY_JSON)  # fmt: skip


def _conforming(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.integers(low, high) | st.integers(-(2**63), 2**63)
    if kind == "number":
        return st.floats(
            schema.get("minimum"), schema.get("maximum"), allow_nan=False
        ) | st.integers(-5, 5)
    if kind == "string":
        return st.text(
            min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40)
        )
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), max_size=4)
    if kind == "object":
        props = schema.get("properties", {})
        required = [k for k in schema.get("required", []) if k in props]
        optional = [k for k in props if k not in required]
        fixed = st.fixed_dictionaries(
            {k: from_schema(props[k]) for k in required},
            optional={k: from_schema(props[k]) for k in optional},
        )
        if schema.get("additionalProperties", True) is False or not props:
            return fixed if props else st.dictionaries(st.text(max_size=8), ANY_JSON, max_size=3)
        extra = st.dictionaries(st.text(max_size=12), ANY_JSON, max_size=2)
        return st.builds(lambda a, b: {**b, **a}, fixed, extra)
    return ANY_JSON


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema without unknown fields and with `model` left out (so most draws reach the
    engine instead of stopping at a 400 / 404)."""
    schema = copy.deepcopy(schema)
    schema["additionalProperties"] = False
    schema["properties"].pop("model", None)
    return schema


#: Every route that reads a JSON body.
BODY_ROUTES = [
    "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
    "/tokenize", "/detokenize", "/v1/responses", "/v1/embeddings",
]  # fmt: skip


def test_openapi_describes_every_generation_body(app: Any) -> None:
    assert set(body_schemas(app)) == set(BODY_ROUTES)


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_fuzzed_bodies_never_get_a_5xx(app: Any, path: str) -> None:
    schema = body_schemas(app)[path]
    bodies = st.one_of(from_schema(closed(schema)), from_schema(schema))

    @FUZZ
    @given(body=bodies)
    def run(body: dict[str, Any]) -> None:
        check(send(app, "POST", path, json.dumps(body).encode()), path)

    run()
    assert send(app, "GET", "/health").status_code == 200


def test_mangled_json_and_model_ids_never_get_a_5xx(app: Any) -> None:
    seed = json.dumps({"prompt": "x", "max_tokens": 2, "n": 1, "stop": ["a"]}).encode()

    @FUZZ
    @given(
        cut=st.integers(0, len(seed)),
        junk=st.binary(max_size=24),
        path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/messages"]),
        model=st.text(max_size=40),
    )
    def run(cut: int, junk: bytes, path: str, model: str) -> None:
        check(send(app, "POST", path, seed[:cut] + junk + seed[cut:]), path)
        check(send(app, "GET", "/v1/models/" + quote(model, safe="")), "/v1/models")

    run()
    assert send(app, "GET", "/health").status_code == 200
