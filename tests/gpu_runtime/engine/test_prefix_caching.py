"""Automatic prefix caching through the scheduler and the engine: admission after a cache hit
(exact block ids, ref counts, `num_cached_tokens`), adapters as an extra key, preemption into
the cache, evictions a step's own allocations make, preview equal to schedule, and greedy
tokens equal with caching on and off (tiny model, fp32 CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.prefix_cache import extend_block_hashes
from gpu_runtime.engine.prefix_keys import PrefixKeys
from gpu_runtime.engine.request import Request, RequestOutput, RequestStatus
from gpu_runtime.model import CausalLM
from tests.gpu_runtime.engine.test_scheduler_preview import _run, _schedule_after_preview

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, detokenize=False, ignore_eos=True)


def _scheduler(blocks: int, budget: int = 16, seqs: int = 4) -> ContinuousBatchingScheduler:
    config = EngineConfig(
        num_kv_blocks=blocks,
        block_size=4,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=64,
    )
    assert config.enable_prefix_caching  # on by default
    return ContinuousBatchingScheduler(config, BlockManager(blocks, 4))


def _request(rid: str, tokens: list[int], max_tokens: int = 4, lora: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), lora_name=lora)


def _finish(s: ContinuousBatchingScheduler, rid: str) -> None:
    s.finish_request(rid, RequestStatus.FINISHED_STOPPED)


PROMPT = list(range(1, 11))  # 10 tokens: blocks of 4, 4 and 2


def test_second_request_starts_after_the_cached_prefix() -> None:
    s = _scheduler(blocks=8)
    s.add_request(_request("a", PROMPT))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 10}
    _run(s, plan)
    a = s.requests["a"]
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    bm = s.block_manager
    assert bm.cache.num_cached_blocks == 2 and bm.cache.block_hash(2) is None
    # b shares a's two full blocks while a runs: ref counts 2, its own third block
    s.add_request(_request("b", [*PROMPT[:8], 50, 51, 52]))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 3}
    new = plan.new_requests[0]
    assert new.request_id == "b" and new.block_ids == [0, 1, 3] and new.num_computed_tokens == 8
    assert [bm.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    _run(s, plan)
    assert s.requests["b"].num_cached_tokens == 8
    _finish(s, "a")
    _finish(s, "b")
    # every cached block is evictable (tables freed from their end), a's tail and b's empty
    assert bm.evictable_block_ids() == [1, 0] and bm.num_used_blocks == 0


def test_a_full_prompt_hit_still_computes_the_last_token() -> None:
    s = _scheduler(blocks=8)
    s.add_request(_request("a", PROMPT[:8]))
    _run(s, s.schedule())
    _finish(s, "a")
    s.add_request(_request("b", PROMPT[:8]))
    plan = s.schedule()
    # both blocks are cached, but the last token's logits are needed: block 1 is recomputed
    assert plan.num_scheduled_tokens == {"b": 4}
    assert plan.new_requests[0].block_ids == [0, 2]
    assert s.requests["b"].num_cached_tokens == 4
    s.add_request(_request("c", PROMPT[:9]))
    plan = s.schedule()
    assert plan.num_scheduled_tokens["c"] == 1 and s.requests["c"].block_table == [0, 1, 3]
    assert s.requests["c"].num_cached_tokens == 8


def test_no_hit_across_adapters_or_the_base_model() -> None:
    s = _scheduler(blocks=12)
    s.add_request(_request("x", PROMPT, lora="x"))
    _run(s, s.schedule())
    for rid, lora in (("y", "y"), ("base", None), ("x2", "x")):
        s.add_request(_request(rid, PROMPT, lora=lora))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"x": 1, "y": 10, "base": 5}  # budget 16
    _run(s, plan)
    plan = s.schedule()
    assert plan.num_scheduled_tokens["x2"] == 2  # only x's blocks serve adapter x
    assert s.requests["x2"].block_table[:2] == s.requests["x"].block_table[:2]
    assert [s.requests[r].num_cached_tokens for r in ("y", "base", "x2")] == [0, 0, 8]


def test_preempted_request_is_recomputed_from_the_cache() -> None:
    s = _scheduler(blocks=5, budget=16)
    s.add_request(_request("a", PROMPT[:8], max_tokens=8))
    s.add_request(_request("b", list(range(20, 28)), max_tokens=8))
    _run(s, s.schedule())
    assert s.requests["a"].block_table == [0, 1] and s.requests["b"].block_table == [2, 3]
    plan = s.schedule()
    # a takes the last empty block (4); b needs one too and preempts itself
    assert plan.num_scheduled_tokens == {"a": 1} and plan.preempted_request_ids == ["b"]
    _run(s, plan)
    b, bm = s.requests["b"], s.block_manager
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_tokens == 9
    assert bm.evictable_block_ids() == [3, 2]  # its table freed into the cache, end first
    _finish(s, "a")  # a's block 4 holds one token (empty), 0 and 1 are cached
    assert bm.evictable_block_ids() == [3, 2, 1, 0] and bm.empty_block_ids() == [4]
    plan = s.schedule()
    # re-admitted on its cached prompt blocks: only its sampled token is recomputed
    assert plan.num_scheduled_tokens == {"b": 1}
    assert plan.new_requests[0].block_ids == [2, 3, 4]
    assert plan.new_requests[0].num_computed_tokens == 8
    assert [bm.ref_count(x) for x in (2, 3, 4)] == [1, 1, 1]
    assert bm.evictable_block_ids() == [1, 0]
    assert b.num_cached_tokens == 0  # recorded at its first admission only


def test_a_hit_evicted_by_the_same_step_is_cut_and_preview_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A running request's new block evicts the oldest cached free block, the second of a
    waiting request's hit: the walk sees the eviction, the hit keeps its first block only,
    and preview and schedule agree."""
    s = _scheduler(blocks=6, budget=16)
    for rid, prompt in (("old", PROMPT[:8]), ("other", list(range(40, 48)))):
        s.add_request(_request(rid, prompt))
        _run(s, s.schedule())
        _finish(s, rid)
    bm = s.block_manager
    assert bm.evictable_block_ids() == [1, 0, 3, 2] and bm.empty_block_ids() == [4, 5]
    s.add_request(_request("r", list(range(90, 98)), max_tokens=8))
    _run(s, s.schedule())
    assert s.requests["r"].block_table == [4, 5]
    s.add_request(_request("w", [*PROMPT[:8], 60]))
    preview, plan = _schedule_after_preview(s, monkeypatch)
    # r's third block evicts block 1; w keeps block 0 and computes from token 4 on, its two
    # new blocks evicting 3 and 2 (0 is claimed by its hit)
    assert plan.num_scheduled_tokens == {"r": 1, "w": 5}
    assert s.requests["r"].block_table == [4, 5, 1]
    assert s.requests["w"].block_table == [0, 3, 2]
    assert s.requests["w"].num_cached_tokens == 4 and preview.new_blocks == 3
    digest = bm.cache.block_hash(0)
    assert bm.evictable_block_ids() == [] and digest is not None
    assert bm.cache.lookup([digest]) == [0] and bm.cache.block_hash(1) is None
    assert bm.cache.num_cached_blocks == 3  # r's two prompt blocks and block 0


def test_preview_equals_schedule_with_hits_evictions_and_preemptions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(5)
    s = _scheduler(blocks=20, budget=12, seqs=5)
    prefixes = [[rng.randint(1, 99) for _ in range(8)] for _ in range(3)]
    hits = preempted = 0
    for step in range(300):
        if step % 2 == 0 and step < 200:
            tail = [rng.randint(1, 99) for _ in range(rng.randint(1, 9))]
            lora = rng.choice([None, None, "x"])
            prompt = rng.choice(prefixes) + tail
            s.add_request(_request(f"r{step}", prompt, rng.randint(1, 9), lora=lora))
        if rng.random() < 0.1:
            s.block_manager.shrink(rng.randint(1, 5))
        elif rng.random() < 0.2:
            removed = set(range(20)) - set(s.block_manager.free_block_ids())
            used = {b for r in s.requests.values() for b in r.block_table}
            s.block_manager.grow(sorted(removed - used))
        preview, plan = _schedule_after_preview(s, monkeypatch)
        hits += sum(1 for new in plan.new_requests if new.num_computed_tokens > 0)
        preempted += len(plan.preempted_request_ids)
        _run(s, plan)
        for request in s.running:
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                _finish(s, request.request_id)
        for request in s.running:  # ref counts are the tables holding each block
            for block_id in request.block_table:
                holders = sum(block_id in r.block_table for r in s.requests.values())
                assert s.block_manager.ref_count(block_id) == holders
    assert hits > 20 and preempted > 0


def test_caching_off_registers_nothing() -> None:
    config = EngineConfig(
        num_kv_blocks=8,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    s = ContinuousBatchingScheduler(config, BlockManager(8, 4))
    for rid in ("a", "b"):
        s.add_request(_request(rid, PROMPT))
        _run(s, s.schedule())
        _finish(s, rid)
    assert s.block_manager.cache.num_cached_blocks == 0
    assert s.block_manager.empty_block_ids() == list(range(8))


# ---- the engine: tokens are those computed without the cache --------------------------------
def _engine_config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=96,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _shared_prompts(seed: int, count: int, prefix_len: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 480, (prefix_len,), generator=gen).tolist()
    tails = [torch.randint(1, 480, (3 + i % 7,), generator=gen).tolist() for i in range(count)]
    return [prefix + tail for tail in tails]


def _staggered(engine: Engine, prompts: list[list[int]]) -> tuple[list[RequestOutput], int]:
    """A new request every step; final outputs in arrival order, and the preemptions seen."""
    ids: list[str] = []
    final: dict[str, RequestOutput] = {}
    pending = list(prompts)
    preemptions = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            ids.append(engine.add_request(pending.pop(0), GREEDY))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        live = engine.scheduler.requests.values()
        preemptions = max([preemptions, *(r.num_preemptions for r in live)])
    return [final[i] for i in ids], preemptions


@pytest.mark.parametrize("blocks", [64, 18], ids=["roomy", "preempting"])
def test_greedy_tokens_equal_with_caching_on_and_off(tiny_llama: CausalLM, blocks: int) -> None:
    prompts = _shared_prompts(3, 12, prefix_len=21)
    off_engine = Engine(tiny_llama, _engine_config(enable_prefix_caching=False))
    off, _ = _staggered(off_engine, prompts)
    engine = Engine(tiny_llama, _engine_config(num_kv_blocks=blocks))
    on, preemptions = _staggered(engine, prompts)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    assert all(o.num_cached_tokens == 0 for o in off)
    assert off_engine.block_manager.cache.num_cached_blocks == 0
    # the first request computes the 5 full prefix blocks; later ones find them (20 tokens)
    cached = [o.num_cached_tokens for o in on]
    assert cached[0] == 0 and cached.count(20) >= 8 and set(cached) <= {0, 20}
    assert (preemptions > 0) == (blocks == 18)
    assert engine.block_manager.num_used_blocks == 0


def test_digests_span_the_prompt_and_the_output() -> None:
    """A request's blocks are named by the digests of its whole token sequence, the blocks
    across the prompt/output boundary and inside the output included."""
    bm = BlockManager(8, 4)
    keys = PrefixKeys(bm)
    request = _request("a", [1, 2, 3, 4, 5, 6])
    request.output_token_ids = [7, 8, 9, 10, 11, 12, 13]
    bm.append_slots(request.block_table, 13)
    request.num_computed_tokens = 12  # blocks 0-2 computed, the last token not yet
    keys.computed(request)
    whole: list[bytes] = []
    extend_block_hashes(whole, list(range(1, 14)), 13, 4, None)
    assert [bm.cache.block_hash(b) for b in request.block_table] == [*whole, None]
    other = _request("b", [*range(1, 13), 99])  # the same 12 tokens as a prompt
    assert keys.hits(other) == request.block_table[:3]
