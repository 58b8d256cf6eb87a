"""The pool wired to the real decode engine on CPU: same tokens as a plain engine while KV pages
move between decode and a finetune budget (unmapped CPU pages are poisoned with NaN)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.memory import (
    EngineMemory,
    MemoryManagerConfig,
    MemoryPoolError,
    MemoryWork,
    create_page_pool,
    engine_kv_layout,
    scheduler_block_demand,
)
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
ENGINE = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=64)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 480, (n,), generator=gen).tolist() for n in lengths]


def _examples(n: int) -> list[Any]:
    """`n` LoRA examples of 12 random tokens, every token a target."""
    from gpu_runtime.finetune.data import TokenizedExample

    gen = torch.Generator().manual_seed(5)
    return [
        TokenizedExample(tuple(ids), tuple(ids))
        for ids in torch.randint(1, 480, (n, 12), generator=gen).tolist()
    ]


def _pooled_engine(model: CausalLM, pages: int, **extra: Any) -> tuple[Engine, EngineMemory]:
    """An engine over a CPU pool of `pages` one-block pages; `extra`: more `EngineConfig`
    fields."""
    layout = engine_kv_layout(model.config, block_size=4, dtype="float32", page_bytes=1)
    page = layout.block_bytes  # one block per page
    pool = create_page_pool(
        device="cpu",
        pool_bytes=pages * page,
        page_bytes=page,
        map_unit_pages=2,
        pinned_tail_pages=2,
    )
    policy = MemoryManagerConfig(
        reserve_low_pages=2,
        reserve_high_pages=6,
        max_step_pages=4,
        shrink_after_iterations=2,
        grow_hold_iterations=1,
    )
    memory = EngineMemory.prepare(
        pool, model.config, block_size=4, kv_dtype="float32", max_model_len=64, config=policy
    )
    fields = {**ENGINE, **memory.engine_config_fields(), **extra}
    config = EngineConfig(**fields)
    engine = Engine(model, config, kv_storage_factory=memory.binding.storage_factory)
    memory.attach(engine)
    return engine, memory


def test_tokens_match_a_plain_engine_while_memory_moves(model: CausalLM) -> None:
    prompts = _prompts(3, (5, 30, 12, 2, 40, 8))
    plain = Engine(model, EngineConfig(num_kv_blocks=128, **ENGINE))  # type: ignore[arg-type]
    expected = [o.output_token_ids for o in plain.generate(prompts, GREEDY)]

    engine, memory = _pooled_engine(model, pages=48)
    pool = memory.manager.pool
    page = pool.page_bytes
    assert memory.manager.usable_blocks >= 16  # one max_model_len request always fits
    memory.manager.finetune.set_demand(40 * page)
    finished: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(prompts)
    step = 0
    work: list[MemoryWork] = []
    counters = memory.manager.counters
    mapped_at_start, maps_at_start = counters.decode_pages_mapped, len(counters.map_latency)
    while pending or engine.has_unfinished_requests() or step < 30:
        if pending and step % 3 == 0:  # bursts of two, then quiet
            ids += [engine.add_request(p, GREEDY) for p in pending[:2]]
            pending = pending[2:]
        memory.before_decode()
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.output_token_ids
        memory.after_decode()
        work += [memory.last_before, memory.last_after]
        # A finetune quantum fitted to the budget it reads, keeping one page of state.
        budget = memory.finetune_budget_bytes()
        if budget >= page:
            memory.quantum_done(peak_bytes=budget, resident_bytes=page)
        assert engine.block_manager.num_usable_blocks == memory.manager.usable_blocks
        pool.check()
        step += 1
    assert [finished[i] for i in ids] == expected
    counters = memory.manager.counters
    assert counters.finetune_grows > 0 and counters.finetune_shrinks > 0
    assert counters.kv_shrinks > 0 and counters.decode_pages_mapped > 0
    assert counters.finetune_budget_violations == 0
    assert memory.lent_bytes() == pool.finetune_budget_bytes > 0
    # Every map, unmap and reclaim ran in a before_decode or after_decode call, and each call's
    # MemoryWork says which.
    # (the engine's first blocks were mapped when the pool was prepared)
    assert sum(w.pages_mapped for w in work) == counters.decode_pages_mapped - mapped_at_start
    assert sum(w.pages_unmapped for w in work) == counters.decode_pages_unmapped > 0
    assert sum(w.maps for w in work) == len(counters.map_latency) - maps_at_start > 0
    assert sum(w.reclaims for w in work) == len(counters.reclaim_latency)
    assert sum(w.map_ms for w in work) <= counters.map_latency.total_s * 1e3 + 1e-9
    assert (
        0
        < sum(w.budget_changes for w in work)
        <= counters.finetune_grows + counters.finetune_shrinks
    )
    assert all(w.ms >= w.map_ms >= 0 for w in work)
    assert len(MemoryWork.names()) == len(work[0].values())


def test_scheduler_demand_counts_next_chunks_and_waiting_prompts(model: CausalLM) -> None:
    engine, memory = _pooled_engine(model, pages=48)
    engine.add_request(list(range(1, 10)), GREEDY)  # 9 tokens: 3 blocks
    engine.add_request(list(range(1, 30)), GREEDY)  # first chunk 24 - 9 = 15 tokens: 4 blocks
    assert scheduler_block_demand(engine) == (0, 7)
    memory.before_decode()
    engine.step()  # admits the first prompt whole and 15 tokens of the second
    running, waiting = scheduler_block_demand(engine)
    # First: one decode token inside its 3 blocks; second: its last 14 tokens, 29 in 8 blocks.
    assert (running, waiting) == (4, 0)


def test_the_host_loop_runs_decode_and_a_lora_job_over_the_pool(model: CausalLM) -> None:
    from gpu_runtime.colocation import HostLoop, NaivePolicy
    from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
    from gpu_runtime.finetune.trainer import LoraTrainer

    engine, memory = _pooled_engine(model, pages=48)
    examples = _examples(4)
    hparams = resolve_hyperparameters(
        n_train_examples=4, n_epochs=1, batch_size=2, lora=LoraSpec(rank=4, alpha=8), seed=0
    )
    loop = HostLoop(engine, NaivePolicy(quantum_examples=1), tpot_slo_ms=1e9, memory=memory)
    memory.finetune_busy = lambda: loop.executor.in_flight is not None
    memory.manager.finetune.set_demand(16 * memory.manager.pool.page_bytes)
    loop.add_job("ft", LoraTrainer(model, examples, hparams))
    ids = [loop.add_request(p, GREEDY) for p in _prompts(4, (6, 20, 9))]
    finished: set[str] = set()
    records = loop.run_until_idle(max_iterations=200)
    for record in records:
        finished |= {f.request_id for f in record.finished}
    loop.close()
    assert finished == set(ids)
    assert loop.job_state("ft").finished and loop.job_state("ft").failed is None
    assert max(r.memory_lent_bytes or 0 for r in records) > 0
    memory.manager.pool.check()


def test_a_loop_planning_ahead_over_the_pool_decodes_as_a_plain_engine(model: CausalLM) -> None:
    """Async scheduling over the pool: the loop plans (and the pool makes room for) each step
    ahead inside the current one, the pool's maintenance runs while the step ahead computes,
    and it waits for that step before unmapping KV pages."""
    from gpu_runtime.colocation import HostLoop, NaivePolicy
    from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
    from gpu_runtime.finetune.trainer import LoraTrainer

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True)
        for n in (12, 20, 6, 16)
    ]
    prompts = _prompts(6, (6, 20, 9, 30))
    plain = Engine(model, EngineConfig(num_kv_blocks=128, **ENGINE))  # type: ignore[arg-type]
    expected = [
        plain.generate([p], q)[0].output_token_ids for p, q in zip(prompts, params, strict=True)
    ]

    static = dict(static_decode_batches=True, cuda_graph_batch_sizes=(1, 2, 4, 8))
    engine, memory = _pooled_engine(model, pages=48, async_scheduling=True, **static)
    assert memory.manager.before_decode_unmap == engine.runner.wait_for_launched
    waits: list[int] = []
    wait_for_launched = engine.runner.wait_for_launched

    def counted() -> None:
        waits.append(memory.manager.pool.kv_prefix_pages)
        wait_for_launched()

    memory.manager.before_decode_unmap = counted
    examples = _examples(8)
    hparams = resolve_hyperparameters(
        n_train_examples=8, n_epochs=2, batch_size=2, lora=LoraSpec(rank=4, alpha=8), seed=0
    )
    outputs: dict[str, list[int]] = {}
    loop = HostLoop(
        engine,
        NaivePolicy(quantum_examples=1),
        tpot_slo_ms=1e9,
        memory=memory,
        output_sink=lambda batch: outputs.update({o.request_id: o.output_token_ids for o in batch}),
    )
    memory.finetune_busy = lambda: loop.executor.in_flight is not None
    memory.manager.finetune.set_demand(16 * memory.manager.pool.page_bytes)
    loop.add_job("ft", LoraTrainer(model, examples, hparams))
    ids = [loop.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    records = loop.run_until_idle(max_iterations=400)
    loop.close()
    assert [outputs[i] for i in ids] == expected
    assert sum(r.planned_ahead for r in records) >= 5
    assert loop.job_state("ft").finished and loop.job_state("ft").failed is None
    counters = memory.manager.counters
    assert counters.kv_shrinks > 0 and len(waits) == counters.kv_shrinks
    assert counters.finetune_budget_violations == 0
    assert engine.block_manager.num_usable_blocks == memory.manager.usable_blocks
    memory.manager.pool.check()


def test_an_over_budget_quantum_is_counted_not_raised(model: CausalLM) -> None:
    _, memory = _pooled_engine(model, pages=48)
    assert not memory.process_wide_peaks  # CPU: peaks are the trainer's own
    memory.quantum_done(peak_bytes=memory.finetune_budget_bytes() + 1, resident_bytes=0)
    assert memory.manager.counters.finetune_budget_violations == 1


def test_attach_rejects_an_engine_not_built_on_the_pool(model: CausalLM) -> None:
    _, memory = _pooled_engine(model, pages=48)
    other = Engine(model, EngineConfig(num_kv_blocks=8, **ENGINE))  # type: ignore[arg-type]
    with pytest.raises(MemoryPoolError, match="not the pool's range"):
        memory.attach(other)


def test_the_budget_read_between_quanta_is_passed_as_the_running_quantums_promise(
    model: CausalLM,
) -> None:
    _, memory = _pooled_engine(model, pages=48)
    page = memory.manager.pool.page_bytes
    busy = [False]
    memory.finetune_busy = lambda: busy[0]
    memory.manager.finetune.set_demand(40 * page)
    memory.before_decode()
    memory.after_decode()  # idle: the pool is lent
    seen: list[int | None] = []
    real = memory.binding.before_step

    def spy(**kwargs: Any) -> Any:
        seen.append(kwargs["promised_bytes"])
        return real(**kwargs)

    memory.binding.before_step = spy  # type: ignore[method-assign]
    promised = memory.finetune_budget_bytes()  # the loop plans a launch: nothing in flight
    assert promised == memory.manager.pool.finetune_budget_bytes > 0
    busy[0] = True
    memory.manager.finetune.set_demand(20 * page)
    memory.after_decode()  # budget above the demand is not taken back while busy
    memory.finetune_budget_bytes()  # read while the quantum runs: not a new promise
    memory.before_decode()
    busy[0] = False
    memory.before_decode()
    assert seen == [promised, None]  # only a running quantum has a promise


def test_cached_free_blocks_are_lent_as_free_pages_and_lose_their_digests(
    model: CausalLM,
) -> None:
    """Prefix-cached blocks no request holds count as free pages: the pool lends them to
    finetuning (dropping their digests) as it does empty ones, never a used block; requests
    sharing the prefix afterwards still get a plain engine's tokens."""
    prefix = _prompts(7, (24,))[0]
    prompts = [prefix + tail for tail in _prompts(8, (12, 14, 13, 15))]
    plain = Engine(model, EngineConfig(num_kv_blocks=128, **ENGINE))  # type: ignore[arg-type]
    expected = [o.output_token_ids for o in plain.generate(prompts, GREEDY)]
    engine, memory = _pooled_engine(model, pages=48)
    bm = engine.block_manager

    hits: list[int] = []

    def run(batch: list[list[int]]) -> list[list[int]]:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            memory.before_decode()
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.output_token_ids
                    hits.append(out.num_cached_tokens)
            memory.after_decode()
            assert set(bm.free_block_ids()) | {
                b for r in engine.scheduler.running for b in r.block_table
            } <= set(range(memory.manager.usable_blocks))
        return [finished[i] for i in ids]

    assert run(prompts[:1]) == expected[:1]
    assert run(prompts[1:3]) == expected[1:3]
    assert hits == [0, 24, 24]  # both start after the cached prefix (6 blocks)
    cached = bm.evictable_block_ids()
    assert len(cached) >= 6 and bm.num_used_blocks == 0
    top = max(cached) + 1
    memory.manager.finetune.set_demand(40 * memory.manager.pool.page_bytes)
    for _ in range(12):  # idle iterations: decode gives pages back, finetune borrows them
        memory.before_decode()
        engine.step()
        memory.after_decode()
        budget = memory.finetune_budget_bytes()
        if budget:
            memory.quantum_done(peak_bytes=budget, resident_bytes=0)
    usable = memory.manager.usable_blocks
    assert usable < top and memory.lent_bytes() > 0  # pages that held cached blocks are lent
    assert all(b < usable for b in bm.evictable_block_ids())
    assert bm.cache.num_cached_blocks == len(bm.evictable_block_ids())  # the lent ones dropped
    assert run(prompts[3:]) == expected[3:]
    assert hits[3] == 24  # the prefix's blocks lay below the lent pages: still cached
    memory.manager.pool.check()
