"""The server surface of speculative decoding, with speculation off (the plumbing, not the
drafts): the `speculative` and `tenant` body fields of completions, chat and messages reach
`Engine.add_request` and the engine's sequences; a non-bool `speculative` or an over-long
`tenant` is a 400 naming it; the draft-lookup tenant derives from the authenticating API key
(a hash, never the key), an explicit tenant only subdivides it; the `metrale_spec_decode_*`
series are always on `/metrics`, and carry the engine's counters through `EngineSnapshot`."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine, EngineSnapshot, SnapshotTaker
from metrale.engine.engine import DEFAULT_TENANT, Engine
from metrale.server.app import create_app
from metrale.server.auth import lookup_tenant
from metrale.server.metrics import ServerMetrics
from metrale.spec.gate import SpecGate
from metrale.spec.stats import SpecStats

KEY = "sk-spec-one"
OTHER_KEY = "sk-spec-two"

SPEC_COUNTERS = (
    "metrale_spec_decode_num_drafts_total",
    "metrale_spec_decode_num_draft_tokens_total",
    "metrale_spec_decode_num_accepted_tokens_total",
    "metrale_spec_decode_verify_steps_total",
    "metrale_spec_decode_drained_steps_total",
)
GATE_LABELS = [("global", "on"), ("global", "off"), ("row", "on"), ("row", "off")]


@dataclass
class Added:
    """What `Engine.add_request` was called with, and what its first sequence holds."""

    request_id: str
    speculative: bool
    lookup_tenant: str | None
    seq_speculative: bool
    seq_tenant: str | None


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[tuple[AsyncEngine, list[Added]]]:
    """An in-process engine whose `add_request` records its speculation arguments."""
    engine = Engine(
        EngineConfig(
            model=str(checkpoint), device="cpu", num_kv_blocks=64, enable_prefix_caching=False
        )
    )
    added: list[Added] = []
    real_add = engine.add_request

    def spy(request_id: str, *args: Any, **kwargs: Any) -> None:
        real_add(request_id, *args, **kwargs)
        seq = engine.requests[request_id].choices[0].seq
        added.append(
            Added(
                request_id,
                kwargs["speculative"],
                kwargs["lookup_tenant"],
                seq.speculative,
                seq.lookup_tenant,
            )
        )

    engine.add_request = spy  # type: ignore[method-assign]
    handle = AsyncEngine(engine)
    handle.start()
    try:
        yield handle, added
    finally:
        handle.shutdown()


def _requests(app: Any, calls: list[tuple[str, dict[str, Any], dict[str, str]]]) -> list:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post(path, json=body, headers=h) for path, body, h in calls]

    return asyncio.run(asyncio.wait_for(run(), 60))


def _completion(**extra: Any) -> dict[str, Any]:
    return {"prompt": "def f(x):", "max_tokens": 2, **extra}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _message(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


# ------------------------------------------------------------------------------- tenant


def test_tenant_is_a_hash_of_the_key_and_an_explicit_tenant_only_subdivides_it() -> None:
    assert lookup_tenant(None) == DEFAULT_TENANT
    assert lookup_tenant(None, "team") == f"{DEFAULT_TENANT}/team"
    one, two = lookup_tenant(KEY), lookup_tenant(OTHER_KEY)
    assert one != two, "two keys share a draft index"
    assert one == "key:" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
    assert one == lookup_tenant(KEY), "not stable"
    assert KEY not in one and OTHER_KEY not in two
    assert lookup_tenant(KEY, "team") == f"{one}/team"
    assert lookup_tenant(KEY, "") == one
    # A client that names another key's tenant (or the default one) stays inside its own.
    for target in (two, f"{two}/team", DEFAULT_TENANT, "../" + two):
        named = lookup_tenant(KEY, target)
        assert named != target and named.startswith(one + "/")
    assert lookup_tenant(None, two) != two


# -------------------------------------------------------------------------- body fields


def test_speculative_and_tenant_reach_the_engine(served: tuple[AsyncEngine, list[Added]]) -> None:
    handle, added = served
    keyed, keyless = create_app(handle, api_key=KEY), create_app(handle)
    bearer, x_key = {"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}
    added.clear()
    replies = _requests(
        keyed,
        [
            ("/v1/completions", _completion(speculative=False, tenant="team-a"), bearer),
            ("/v1/completions", _completion(prompt=["a", "b"], speculative=False), bearer),
            ("/v1/chat/completions", _chat(), bearer),
            ("/v1/chat/completions", _chat(speculative=True, tenant="t", stream=True), x_key),
            ("/v1/messages", _message(speculative=False, tenant="m"), x_key),
            ("/v1/messages", _message(), bearer),
        ],
    )
    replies += _requests(
        keyless,
        [
            ("/v1/completions", _completion(), {}),
            ("/v1/chat/completions", _chat(speculative=False, tenant="solo"), {}),
            # A key sent to a server without keys authenticates nothing: default tenant.
            ("/v1/messages", _message(), bearer),
        ],
    )
    assert [r.status_code for r in replies] == [200] * 9, [r.text for r in replies]
    mine = lookup_tenant(KEY)
    expected = [
        (False, f"{mine}/team-a"),
        (False, mine),
        (False, mine),  # both prompts of one completions request
        (True, mine),
        (True, f"{mine}/t"),
        (False, f"{mine}/m"),
        (True, mine),
        (True, DEFAULT_TENANT),
        (False, f"{DEFAULT_TENANT}/solo"),
        (True, DEFAULT_TENANT),
    ]
    assert [(a.speculative, a.lookup_tenant) for a in added] == expected
    assert [(a.seq_speculative, a.seq_tenant) for a in added] == expected  # the engine's state
    assert all(KEY not in (a.lookup_tenant or "") for a in added)


@pytest.mark.parametrize("value", ["false", 0, 1, None, "no"])
def test_a_non_bool_speculative_is_a_400_naming_it(
    served: tuple[AsyncEngine, list[Added]], value: Any
) -> None:
    handle, added = served
    added.clear()
    replies = _requests(
        create_app(handle),
        [
            ("/v1/completions", _completion(speculative=value), {}),
            ("/v1/chat/completions", _chat(speculative=value), {}),
            ("/v1/messages", _message(speculative=value), {}),
        ],
    )
    for reply in replies:
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "speculative", reply.text
        assert "speculative" in reply.json()["error"]["message"]
    assert replies[2].json()["type"] == "error"  # the Anthropic shape on /v1/messages
    assert not added, "a refused request reached the engine"


def test_a_bad_tenant_is_a_400_naming_it(served: tuple[AsyncEngine, list[Added]]) -> None:
    handle, added = served
    added.clear()
    replies = _requests(
        create_app(handle),
        [
            ("/v1/completions", _completion(tenant="x" * 257), {}),
            ("/v1/chat/completions", _chat(tenant=7), {}),
            ("/v1/messages", _message(tenant=["a"]), {}),
        ],
    )
    for reply in replies:
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "tenant", reply.text
    ok = _requests(create_app(handle), [("/v1/completions", _completion(tenant="x" * 256), {})])
    assert ok[0].status_code == 200, ok[0].text
    assert [a.lookup_tenant for a in added] == [f"{DEFAULT_TENANT}/{'x' * 256}"]


# ------------------------------------------------------------------------------ metrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_spec_metrics_are_exported_as_zeros_when_speculation_is_off(
    served: tuple[AsyncEngine, list[Added]],
) -> None:
    handle, _ = served

    async def scrape() -> str:
        transport = httpx.ASGITransport(app=create_app(handle, api_key=KEY))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            reply = await client.get("/metrics")  # open: no key needed
            assert reply.status_code == 200
            return reply.text

    text = asyncio.run(scrape())
    samples = _samples(text)
    for name in SPEC_COUNTERS:
        assert samples[(name, ())] == 0.0, name
    for scope, to in GATE_LABELS:
        key = ("metrale_spec_decode_gate_switches_total", (("scope", scope), ("to", to)))
        assert samples[key] == 0.0
    # No draft slots when speculation is off: the family is declared, with no positions.
    assert "# HELP metrale_spec_decode_num_accepted_tokens_per_pos" in text
    assert not any(n == "metrale_spec_decode_num_accepted_tokens_per_pos_total" for n, _ in samples)


def test_spec_counters_cross_the_snapshot_into_the_exposition(
    served: tuple[AsyncEngine, list[Added]], monkeypatch: pytest.MonkeyPatch
) -> None:
    handle, _ = served
    engine = handle.engine
    stats = SpecStats(verify_steps=5, drained_for_spec=7)
    stats.record(3, 2)
    stats.record(3, 0)
    stats.record(2, 1)
    gate = SpecGate(3)
    gate.counters.update(global_off=1, global_on=2, row_off=3, row_on=4)
    monkeypatch.setattr(engine.speculation, "stats", stats)
    monkeypatch.setattr(engine.speculation, "gate", gate)
    monkeypatch.setattr(engine.speculation, "k", 4)
    snap = pickle.loads(pickle.dumps(SnapshotTaker(engine).take()))  # it crosses the pipe
    assert snap.spec == stats and snap.spec is not engine.spec_stats
    assert snap.spec_gate == gate.counters and snap.num_speculative_tokens == 4
    stats.record(1, 1)  # the snapshot is a copy: later counts do not leak into it
    assert snap.spec.num_drafts == 3

    class Handle:
        def snapshot(self) -> EngineSnapshot:
            return snap

    samples = _samples(ServerMetrics(Handle(), "m").exposition().decode())  # type: ignore[arg-type]
    assert samples[("metrale_spec_decode_num_drafts_total", ())] == 3
    assert samples[("metrale_spec_decode_num_draft_tokens_total", ())] == 8
    assert samples[("metrale_spec_decode_num_accepted_tokens_total", ())] == 3
    assert samples[("metrale_spec_decode_verify_steps_total", ())] == 5
    assert samples[("metrale_spec_decode_drained_steps_total", ())] == 7
    per_pos = {
        dict(labels)["position"]: value
        for (name, labels), value in samples.items()
        if name == "metrale_spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 2, "1": 1, "2": 0, "3": 0}  # padded to k
    switches = {
        (dict(labels)["scope"], dict(labels)["to"]): value
        for (name, labels), value in samples.items()
        if name == "metrale_spec_decode_gate_switches_total"
    }
    assert switches == {
        ("global", "off"): 1,
        ("global", "on"): 2,
        ("row", "off"): 3,
        ("row", "on"): 4,
    }


# ------------------------------------------------------------------ speculation on


def test_a_speculating_server_keeps_greedy_text_and_counts_its_drafts(checkpoint: Path) -> None:
    """A server with `speculative_config`: the same greedy completions as without it, an
    opted-out request among them, and the counters on `/metrics` move."""
    text = "x = 1\ny = 2\n" * 6
    body = {"prompt": text, "max_tokens": 24, "temperature": 0}

    def serve(spec: dict[str, Any] | None) -> tuple[list[dict[str, Any]], str]:
        config = EngineConfig(
            model=str(checkpoint), device="cpu", num_kv_blocks=64, speculative_config=spec
        )
        handle = AsyncEngine(Engine(config))
        handle.start()
        try:
            app = create_app(handle)
            replies = _requests(
                app,
                [
                    ("/v1/completions", body, {}),
                    ("/v1/completions", {**body, "speculative": False}, {}),
                ],
            )

            async def scrape() -> str:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    return (await c.get("/metrics")).text

            handle.snapshot()
            metrics = asyncio.run(scrape())
        finally:
            handle.shutdown()
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json() for r in replies], metrics

    off, _ = serve(None)
    on, metrics = serve({"method": "ngram", "num_speculative_tokens": 3, "gate": "off"})
    texts_off = [r["choices"][0]["text"] for r in off]
    assert [r["choices"][0]["text"] for r in on] == texts_off
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert values["metrale_spec_decode_num_draft_tokens_total"] > 0
    assert values["metrale_spec_decode_verify_steps_total"] > 0
