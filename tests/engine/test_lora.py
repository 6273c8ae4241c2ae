"""LoRA in the engine: a mixed batch (base + two adapters, prefill chunks beside decode rows)
gives every request the tokens it gets alone, with slots rotating (`max_loras=1`) and under
preemption; admission waits for a slot without starving base requests; slots come back on
every exit path; bad adapters are refused naming the file and tensor, and serving goes on;
an adapter in use cannot be unloaded; adapters never share prefix-cache blocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, LoRARequest, SamplingParams
from metrale.errors import InvalidRequestError
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.lora import ADAPTER_A, ADAPTER_B, build_adapter

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")


def adapters() -> tuple[LoRARequest, LoRARequest]:
    base = build(VARIANT)
    return (
        LoRARequest(ADAPTER_A.name, 1, str(build_adapter(base, ADAPTER_A))),
        LoRARequest(ADAPTER_B.name, 2, str(build_adapter(base, ADAPTER_B))),
    )


def workload() -> tuple[list[list[int]], list[SamplingParams], list[LoRARequest | None]]:
    a, b = adapters()
    g = torch.Generator().manual_seed(5)
    lengths = [40, 3, 70, 12, 25, 90, 7, 33, 55, 18, 64, 9]
    prompts = [torch.randint(6, 512, (n,), generator=g).tolist() for n in lengths]
    params = [
        SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
        if i % 3
        else SamplingParams(temperature=0.9, top_k=40, max_tokens=24, min_tokens=24, seed=7 + i)
        for i in range(len(prompts))
    ]
    return prompts, params, [(a, b, None)[i % 3] for i in range(len(prompts))]


def make_llm(**kwargs: object) -> LLM:
    options: dict[str, object] = dict(
        device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_num_seqs=12,
        num_kv_blocks=300, max_prefill_chunk=32,
    )  # fmt: skip
    options.update(kwargs)
    return LLM(str(build(VARIANT)), **options)


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each request of the workload run by itself."""
    llm = make_llm()
    prompts, params, loras = workload()
    out = []
    for p, sp, lr in zip(prompts, params, loras, strict=True):
        out.append(llm.generate([p], [sp], lora_request=[lr])[0].outputs[0].token_ids)
    assert_no_leaks(llm.engine)
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_loras": 1},
        {"num_kv_blocks": 24},
        {"num_kv_blocks": 24, "preemption_mode": "swap", "max_loras": 1},
    ],
    ids=["2-slots", "1-slot-rotates", "preempt-recompute", "preempt-swap-1-slot"],
)
def test_mixed_batch_equals_each_request_alone(alone: list[list[int]], kwargs: dict) -> None:
    llm = make_llm(**kwargs)
    prompts, params, loras = workload()
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    assert together == alone
    stats, sched = llm.engine.lora_stats(), llm.engine.scheduler.stats
    if kwargs.get("max_loras") == 1:
        assert stats["evictions"] >= 2, stats  # the one slot really rotated
    if "num_kv_blocks" in kwargs:
        assert sched.preemptions_recompute + sched.preemptions_swap > 0
    assert_no_leaks(llm.engine)


def test_a_request_waiting_for_a_slot_lets_base_requests_past_but_is_not_starved() -> None:
    a, b = adapters()
    llm = make_llm(max_loras=1)
    engine = llm.engine
    ids = {lr.lora_name: engine.lora_adapter_id(lr) for lr in (a, b)}
    long = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    engine.add_request("a0", [7, 8, 9], long, adapter_id=ids["sql"])
    engine.add_request("b0", [7, 8, 9], long, adapter_id=ids["poet"])
    engine.add_request("a1", [7, 8, 10], long, adapter_id=ids["sql"])  # behind b0
    engine.add_request("base", [7, 8, 9], long)
    engine.step()
    running = {s.seq_id for s in engine.scheduler.running}
    assert running == {"a0", "base"}, running  # base went past b0; a1 waits behind b0
    assert engine.lora_stats()["waiting_for_slot"] == 2
    finished_order = []
    while engine.has_unfinished():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order.index("b0") < finished_order.index("a1")
    assert engine.lora_stats()["waiting_for_slot"] == 0
    assert_no_leaks(engine)


def test_aborts_release_slots_on_every_path() -> None:
    a, _ = adapters()
    llm = make_llm(max_loras=1)
    engine = llm.engine
    aid = engine.lora_adapter_id(a)
    sp = SamplingParams(temperature=0, max_tokens=30, min_tokens=30)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(10, 40 + i)), sp, adapter_id=aid)
    engine.step()
    engine.abort_request("r0")  # running
    engine.step()
    engine.abort_request("r3")
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)
    assert engine.lora_stats()["resident"] == 1


def test_adapters_never_share_prefix_cache_blocks() -> None:
    a, _ = adapters()
    llm = make_llm()
    prompt = list(range(20, 84))
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], sp, lora_request=a)[0]
    base = llm.generate([prompt], sp)[0]
    again = llm.generate([prompt], sp, lora_request=a)[0]
    assert first.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens >= 48


def test_unload_of_an_adapter_in_use_is_refused_then_allowed() -> None:
    a, _ = adapters()
    llm = make_llm()
    engine = llm.engine
    aid = engine.lora_adapter_id(a)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4), adapter_id=aid)
    with pytest.raises(InvalidRequestError, match="in use by 1 unfinished request"):
        engine.unload_lora_adapter(a.lora_name)
    while engine.has_unfinished():
        engine.step()
    assert engine.unload_lora_adapter(a.lora_name) == aid
    with pytest.raises(InvalidRequestError, match="not loaded"):
        engine.add_request("r2", [5, 6], SamplingParams(max_tokens=2), adapter_id=aid)
    # Loaded again, it gets a new id: no prefix-cache namespace is ever reused, not even
    # when a caller asks for the old one.
    with pytest.raises(InvalidRequestError, match=f"id {aid} was already used"):
        engine.load_lora_adapter(a.lora_name, a.lora_path, aid)
    assert engine.lora_adapter_id(a) != aid
    assert_no_leaks(engine)


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, edit) -> None:
    tensors = load_file(str(d / "adapter_model.safetensors"))
    save_file(edit(tensors), str(d / "adapter_model.safetensors"))


def _bad_adapters(tmp: Path, good: str) -> list[tuple[Path, str]]:
    cases: list[tuple[Path, str]] = []
    d = _copy(good, tmp / "modules_to_save")
    _edit_config(d, modules_to_save=["lm_head"])
    cases.append((d, "adapter_config.json: modules_to_save"))
    d = _copy(good, tmp / "experts")
    _edit_tensors(
        d,
        lambda t: {k.replace("mlp.down_proj", "mlp.experts.0.down_proj"): v for k, v in t.items()},
    )
    cases.append((d, r"tensor base_model\.model\.model\.layers\.0\.mlp\.experts\.0\.down_proj"))
    d = _copy(good, tmp / "target_parameters")
    _edit_config(d, target_parameters=["mlp.experts.gate_up_proj"])
    cases.append((d, "adapters of MoE experts"))
    d = _copy(good, tmp / "shape")
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    _edit_tensors(d, lambda t: {**t, key: torch.zeros(8, 32)})
    cases.append(
        (
            d,
            r"adapter_model\.safetensors: tensor model\.layers\.1\.self_attn\.q_proj\.lora_A\.weight has shape \[8, 32\]",
        )
    )
    d = _copy(good, tmp / "missing_b")
    _edit_tensors(
        d, lambda t: {k: v for k, v in t.items() if "layers.0.mlp.down_proj.lora_B" not in k}
    )
    cases.append((d, r"tensor model\.layers\.0\.mlp\.down_proj\.lora_B\.weight is missing"))
    d = _copy(good, tmp / "no_weights")
    (d / "adapter_model.safetensors").unlink()
    cases.append((d, r"no_weights/adapter_model\.safetensors: missing"))
    d = _copy(good, tmp / "no_config")
    (d / "adapter_config.json").unlink()
    cases.append((d, r"no_config/adapter_config\.json: missing"))
    d = _copy(good, tmp / "corrupt")
    (d / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    cases.append((d, r"corrupt/adapter_model\.safetensors: unreadable"))
    return cases


def test_bad_adapters_are_refused_naming_file_and_tensor_and_serving_goes_on(
    tmp_path: Path,
) -> None:
    a, _ = adapters()
    llm = make_llm(max_lora_rank=8)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6)
    before = llm.generate([[5, 6, 7]], sp, lora_request=a)[0].outputs[0].token_ids
    registered = [e.name for e in engine.model.lora_adapters()]
    stats = engine.lora_stats()
    for i, (path, message) in enumerate(_bad_adapters(tmp_path, a.lora_path)):
        with pytest.raises(InvalidRequestError, match=message):
            engine.load_lora_adapter(f"bad{i}", str(path))
    over_rank = make_llm(max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="rank 8 exceeds --max-lora-rank 4"):
        over_rank.engine.load_lora_adapter("big", a.lora_path)
    with pytest.raises(InvalidRequestError, match="already loaded"):
        engine.load_lora_adapter(a.lora_name, a.lora_path)
    assert [e.name for e in engine.model.lora_adapters()] == registered
    assert engine.lora_stats() == stats
    after = llm.generate([[5, 6, 7]], sp, lora_request=a)[0].outputs[0].token_ids
    assert after == before
    assert_no_leaks(engine)


def test_lora_request_without_lora_enabled_is_refused() -> None:
    a, _ = adapters()
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="LoRA adapters are not enabled"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora_request=a)


def test_adapters_never_share_the_cross_request_draft_lookup() -> None:
    a, _ = adapters()
    llm = make_llm()
    engine = llm.engine
    aid = engine.lora_adapter_id(a)
    engine.add_request("base", [5, 6, 7], SamplingParams(max_tokens=2), lookup_tenant="t")
    engine.add_request("lora", [5, 6, 7], SamplingParams(max_tokens=2), adapter_id=aid,
                       lookup_tenant="t")  # fmt: skip
    tenants = {s.seq_id: s.lookup_tenant for s in engine.scheduler.waiting}
    assert tenants["base"] == "t" and tenants["lora"] == f"t/lora:{aid}"
    while engine.has_unfinished():
        engine.step()


def test_speculative_verify_rows_run_their_adapter(alone: list[list[int]]) -> None:
    """With n-gram drafts verified in the step's forward, greedy adapter rows keep their
    tokens (the verify rows' deltas use each row's slot)."""
    llm = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "gate": "off", "prompt_lookup_min": 1})  # fmt: skip
    prompts, params, loras = workload()
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    outs = llm.generate([prompts[i] for i in greedy], [params[i] for i in greedy],
                        lora_request=[loras[i] for i in greedy])  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == [alone[i] for i in greedy]
    assert llm.engine.spec_stats.num_draft_tokens > 0
    assert_no_leaks(llm.engine)


def test_seed_promotion_methods_place_adapters_and_name_the_evicted_one() -> None:
    a, b = adapters()
    llm = make_llm(max_loras=1, max_cpu_loras=1)
    model = llm.engine.model
    slot, evicted = model.promote_lora_from_disk(a.lora_path, a.lora_name)
    assert (slot, evicted) == (0, None)
    assert model.promote_lora_from_disk(a.lora_path, a.lora_name) == (0, None)  # resident
    slot, evicted = model.promote_lora_from_disk(b.lora_path, b.lora_name)
    assert (slot, evicted) == (0, a.lora_name)
    model.swap_lora_from_disk(a.lora_path, a.lora_name, 0)  # back, read from disk again
    assert model.adapter_id_for(0) == llm.engine.lora_adapter(a.lora_name).adapter_id
    stats = llm.engine.lora_stats()
    assert stats["evictions"] == 2 and stats["disk_loads"] >= 1
    # The slot's contents really are adapter a's again: same tokens as a fresh engine.
    sp = SamplingParams(temperature=0, max_tokens=8)
    got = llm.generate([[9, 8, 7]], sp, lora_request=a)[0].outputs[0].token_ids
    assert got == make_llm().generate([[9, 8, 7]], sp, lora_request=a)[0].outputs[0].token_ids


def test_bench_lora_writes_its_record(tmp_path: Path) -> None:
    """`metrale bench lora` (the H200 record's instrument) runs end to end on a tiny config:
    every adapter resident, no adapter step left to the eager path, both ratios recorded."""
    import argparse

    from metrale.bench import lora as bench_lora

    parser = argparse.ArgumentParser()
    bench_lora.add_arguments(parser)
    args = parser.parse_args([
        "--config-dir", "bench/configs/tiny-2k", "--device", "cpu", "--adapters", "2",
        "--rank", "4", "--concurrency", "3", "--requests", "4", "--prompt-len", "8",
        "--output-len", "4", "--latency-tokens", "4", "--out-dir", str(tmp_path),
    ])  # fmt: skip
    figures = bench_lora.run(args)
    assert figures["lora_stats"]["resident"] == 2 and figures["lora_eager_forwards"] == 0
    assert figures["throughput_ratio"] > 0 and figures["decode_ratio"] > 0
    (record,) = tmp_path.glob("*-lora-tiny-2k.json")
    assert json.loads(record.read_text())["instrument"] == "lora"


def test_chat_takes_a_lora_request() -> None:
    a, _ = adapters()
    llm = make_llm()
    sp = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    messages = [{"role": "user", "content": "hello there"}]
    chat = llm.chat(messages, sp, lora_request=a)[0]
    same = llm.generate([chat.prompt_token_ids], sp, lora_request=a)[0]
    base = llm.chat(messages, sp)[0]
    assert chat.outputs[0].token_ids == same.outputs[0].token_ids
    assert chat.outputs[0].token_ids != base.outputs[0].token_ids
