"""Issue 24, cache isolation: under `--prefix-cache-isolation api-key` a prompt sent with key A
gives key B `cached_tokens: 0` while A still hits; with different `cache_salt`s the same holds
on a shared cache (no salt is its own namespace too). Several keys are accepted, each its own
tenant; a keys file is read. In-process (`AsyncEngine`, the app over httpx's ASGI transport)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metrale.engine.async_engine import AsyncEngine
from metrale.errors import InvalidRequestError
from metrale.scheduler.sequence import prefix_namespace
from metrale.server.app import create_app
from metrale.server.auth import read_key_file
from tests.server.helpers import running_engine

PROMPT = "def fibonacci(n):\n    " + "# compute the n-th number of the sequence\n    " * 6


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[AsyncEngine]:
    with running_engine(checkpoint, num_kv_blocks=128, enable_prefix_caching=True) as handle:
        yield handle


def cached(app: Any, key: str | None, path: str = "/v1/completions", **extra: Any) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": extra.pop("head", "") + PROMPT, "max_tokens": 1}
    else:
        body = {"messages": [{"role": "user", "content": extra.pop("head", "") + PROMPT}],
                "max_tokens": 1}  # fmt: skip
    body.update(extra)

    async def go() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            reply = await c.post(path, json=body, headers=headers, timeout=30)
            assert reply.status_code == 200, reply.text
            return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    return asyncio.run(go())


def test_api_key_isolation_keeps_tenants_apart(engine: AsyncEngine) -> None:
    app = create_app(engine, api_key=["key-a", "key-b"], prefix_cache_isolation="api-key")
    head = "# isolation\n"
    assert cached(app, "key-a", head=head) == 0
    assert cached(app, "key-b", head=head) == 0, "tenant B hit tenant A's prefix"
    assert cached(app, "key-a", head=head) > 0, "the same tenant must still hit"
    assert cached(app, "key-b", head=head) > 0
    # The chat route too; and a salt subdivides a tenant's cache.
    assert cached(app, "key-a", "/v1/chat/completions", head=head) == 0
    assert cached(app, "key-b", "/v1/chat/completions", head=head) == 0
    assert cached(app, "key-a", head=head, cache_salt="s") == 0
    # Without isolation both keys share one cache.
    shared = create_app(engine, api_key=["key-a", "key-b"])
    assert cached(shared, "key-a", head="# shared\n") == 0
    assert cached(shared, "key-b", head="# shared\n") > 0


def test_different_cache_salts_never_share_blocks(engine: AsyncEngine) -> None:
    app = create_app(engine)
    head = "# salted\n"
    assert cached(app, None, head=head, cache_salt="alpha") == 0
    assert cached(app, None, head=head, cache_salt="beta") == 0
    assert cached(app, None, head=head) == 0, "an unsalted request hit a salted prefix"
    assert cached(app, None, head=head, cache_salt="alpha") > 0
    assert cached(app, None, head=head, cache_salt="beta") > 0
    assert cached(app, None, head=head) > 0


def test_cache_salt_and_isolation_are_validated(engine: AsyncEngine, tmp_path: Path) -> None:
    app = create_app(engine)

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for salt in ("", 5, "x" * 300):
                body = {"prompt": "x", "max_tokens": 1, "cache_salt": salt}
                reply = await c.post("/v1/completions", json=body)
                assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt"

    asyncio.run(go())
    with pytest.raises(InvalidRequestError, match="needs at least one"):
        create_app(engine, prefix_cache_isolation="api-key")
    with pytest.raises(InvalidRequestError):
        create_app(engine, api_key="k", prefix_cache_isolation="tenant")
    keys = tmp_path / "keys"
    keys.write_text("# comment\nkey-1\n\n  key-2  \n")
    assert read_key_file(str(keys)) == ["key-1", "key-2"]
    # Namespaces: a salt never collides with a plain adapter id, and is stable.
    assert prefix_namespace(0, None) == 0 and prefix_namespace(3, "") == 3
    assert prefix_namespace(0, "a") == prefix_namespace(0, "a") >= 1 << 62
    assert prefix_namespace(0, "a") != prefix_namespace(1, "a") != prefix_namespace(0, "b")
