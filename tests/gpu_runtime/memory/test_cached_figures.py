"""The per-iteration shortcuts of the memory policy decide exactly what a fresh computation does.

`DecodeHistory` keeps its windows' maxima from `observe` on, `FinetuneBudget` keeps the reclaim
headroom until its inputs change, `return_unwanted_budget` returns before reading the backend
when the budget is not above the demand, and `EngineMemory.after_decode` counts only the waiting
requests' blocks. Each is compared here with a computation from scratch: an independent
reference for the history, and a manager without any of the shortcuts (the code as it was)
driven through the same random sequence of decode and finetune demands, whose every decision
(page moves, budget, counters, grants, plans) must be the same.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.memory import (
    CpuPageBackend,
    DecodeDemand,
    KVLayout,
    MemoryManager,
    MemoryManagerConfig,
    PagePool,
    scheduler_block_demand,
    scheduler_waiting_blocks,
)
from gpu_runtime.memory.finetune_budget import FinetuneBudget
from gpu_runtime.memory.headroom import DecodeHistory
from gpu_runtime.model import build_random_model
from gpu_runtime.model.tiny import tiny_config

PAGE = 4096


def _reference_history(
    config: MemoryManagerConfig, layout: KVLayout, observed: list[int], kv_prefix_pages: int
) -> tuple[int, int, int, int]:
    """(refill growth, peak used, headroom with and without the peak) from the whole list of
    observations, as the module docstring of `headroom.py` defines them."""
    growth = [max(b - a, 0) for a, b in zip(observed, observed[1:], strict=False)]
    refill = max(growth[-config.growth_window :], default=0)
    headroom_growth = max(growth[-config.headroom_window :], default=0)
    prior = [config.plan_peak_prior_blocks] if config.plan_peak_prior_blocks else []
    peak = 0
    if config.plan_peak_window:
        peak = max((prior + observed)[-config.plan_peak_window :], default=0)
    pages = max(
        layout.pages_for_blocks(headroom_growth * config.plan_headroom_intervals),
        config.plan_headroom_min_pages,
    )
    with_peak = pages
    if config.plan_peak_window:
        low = layout.blocks_in_pages(config.reserve_low_pages)
        with_peak = max(pages, layout.pages_for_blocks(peak + low) - kv_prefix_pages)
    return refill, peak, with_peak, pages


@settings(max_examples=200, deadline=None)
@given(
    growth_window=st.integers(1, 5),
    headroom_window=st.integers(1, 9),
    peak_window=st.integers(0, 7),
    prior=st.integers(0, 60),
    intervals=st.integers(0, 4),
    floor=st.integers(0, 8),
    observed=st.lists(st.integers(0, 200), max_size=40),
    prefix=st.integers(0, 100),
)
def test_history_maxima_equal_a_fresh_computation(
    growth_window: int,
    headroom_window: int,
    peak_window: int,
    prior: int,
    intervals: int,
    floor: int,
    observed: list[int],
    prefix: int,
) -> None:
    config = MemoryManagerConfig(
        growth_window=growth_window,
        headroom_window=headroom_window,
        plan_peak_window=peak_window,
        plan_peak_prior_blocks=prior,
        plan_headroom_intervals=intervals,
        plan_headroom_min_pages=floor,
    )
    layout = KVLayout(page_bytes=PAGE, block_bytes=PAGE // 2)
    history = DecodeHistory(config, layout)
    for count in range(len(observed) + 1):
        if count:
            history.observe(observed[count - 1])
        refill, peak, with_peak, without = _reference_history(
            config, layout, observed[:count], prefix
        )
        assert history.version == count
        assert history.refill_growth_blocks() == refill
        assert history.peak_used_blocks() == peak
        assert history.headroom_pages(prefix) == with_peak
        assert history.headroom_pages(prefix, with_peak=False) == without


class _FreshHistory(DecodeHistory):
    """The history as it was: every figure a pass over its window."""

    def refill_growth_blocks(self) -> int:
        return max(self._interval_growth, default=0)

    def peak_used_blocks(self) -> int:
        return max(self._recent_used, default=0) if self._config.plan_peak_window else 0

    def headroom_pages(self, kv_prefix_pages: int, *, with_peak: bool = True) -> int:
        self._headroom_growth_max = max(self._headroom_growth, default=0)
        self._peak_used = self.peak_used_blocks()
        return super().headroom_pages(kv_prefix_pages, with_peak=with_peak)


class _FreshBudget(FinetuneBudget):
    """The finetune budget as it was: no cached headroom, backend reads before the demand
    check."""

    def reclaim_headroom_pages(self, *, with_peak: bool = True) -> int:
        return self._reclaim_headroom_uncached(with_peak=with_peak)

    def return_unwanted_budget(self) -> None:
        excess = self.pool.finetune_pages - self._demand_pages
        count = min(excess, self.pool.finetune_reclaimable_pages(), self.config.max_step_pages)
        if count <= 0:
            return
        super().return_unwanted_budget()


def _build(fresh: bool, config: MemoryManagerConfig, unit: int) -> MemoryManager:
    """A manager; `fresh`: with the history and the finetune budget as they were."""
    pool = PagePool(CpuPageBackend(num_pages=96, page_bytes=PAGE, map_unit_pages=unit))
    layout = KVLayout(page_bytes=PAGE, block_bytes=PAGE)
    manager = MemoryManager(pool, layout, config, clock=lambda: 0.0)
    if fresh:
        history = _FreshHistory(config, layout)
        manager._history = history
        manager.finetune = _FreshBudget(
            pool, config, manager.counters, history, manager.moves, lambda: 0.0
        )
    return manager


def _state(manager: MemoryManager) -> tuple[Any, ...]:
    pool = manager.pool
    counters = {
        k: v for k, v in manager.counters.as_dict().items() if not k.endswith(("p50", "p99"))
    }
    return (
        pool.kv_prefix_pages,
        pool.finetune_pages,
        pool.free_pages,
        pool.backend.finetune_reserved_bytes(),
        manager.finetune.plan_bytes(),
        manager.finetune.release_plan_bytes(),
        counters,
    )


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["step", "step", "refill", "refill", "quantum", "demand"]),
        st.integers(-6, 10),  # change of decode's used blocks (a walk); demand: pages / 4
        st.integers(0, 6),  # next-step blocks
        st.integers(0, 12),  # waiting blocks
        st.booleans(),  # finetune busy
        st.floats(0.0, 1.0),  # share of the plan a quantum peaks at
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(
    static=st.booleans(),
    unit=st.sampled_from([1, 2]),
    peak_window=st.sampled_from([0, 3]),
    intervals=st.sampled_from([0, 2]),
    ops=_OPS,
)
def test_decisions_equal_those_of_a_manager_without_shortcuts(
    static: bool, unit: int, peak_window: int, intervals: int, ops: list[Any]
) -> None:
    config = MemoryManagerConfig(
        reserve_low_pages=4,
        reserve_high_pages=10,
        max_step_pages=4 * unit,
        shrink_after_iterations=10**9 if static else 2,
        grow_hold_iterations=2,
        min_decode_pages=16 if static else 1,
        plan_headroom_intervals=intervals,
        plan_headroom_min_pages=2,
        plan_peak_window=peak_window,
        reclaim_from_finetune=not static,
    )
    managers = [_build(False, config, unit), _build(True, config, unit)]
    for m in managers:
        m.finetune.set_demand(64 * PAGE)
    used = 0
    for op, delta, nxt, waiting, busy, share in ops:
        results: list[Any] = []
        used = max(used + delta, 0) if op != "demand" else used
        for m in managers:
            used_now = min(used, m.usable_blocks)
            demand = DecodeDemand(used_now, nxt, waiting, top_used_block=used_now)
            if op == "step":
                grant = m.before_step(demand, finetune_busy=busy)
                after = DecodeDemand(
                    min(used_now + nxt, m.usable_blocks),
                    waiting_blocks=waiting,
                    top_used_block=min(used_now + nxt, m.usable_blocks),
                )
                m.maintain(after, finetune_busy=busy)
                results.append(grant)
            elif op == "refill":
                results.append(m.refill_reserve(demand))
            elif op == "quantum":
                plan = m.finetune.plan_bytes()
                peak = min(int(plan * share), m.finetune.budget_bytes)
                m.finetune.quantum_done(peak_bytes=peak, resident_bytes=peak // 4)
                results.append(plan)
            else:
                m.finetune.set_demand(max(delta, 0) * 4 * PAGE)
            results.append(_state(m))
        assert results[: len(results) // 2] == results[len(results) // 2 :]


class _CountingBackend(CpuPageBackend):
    """The CPU backend, counting the reads that cost a torch stats call on CUDA."""

    reads = 0

    def finetune_reserved_bytes(self) -> int:
        self.reads += 1
        return super().finetune_reserved_bytes()

    def finetune_allocated_bytes(self) -> int:
        self.reads += 1
        return super().finetune_allocated_bytes()


def test_a_budget_within_the_demand_is_returned_without_backend_reads() -> None:
    backend = _CountingBackend(num_pages=64, page_bytes=PAGE)
    config = MemoryManagerConfig(
        reserve_low_pages=4, reserve_high_pages=12, max_step_pages=4, grow_hold_iterations=0
    )
    manager = MemoryManager(PagePool(backend), KVLayout(page_bytes=PAGE, block_bytes=PAGE), config)
    manager.finetune.set_demand(64 * PAGE)
    demand = DecodeDemand(0, top_used_block=0)
    manager.maintain(demand)  # lends the idle pages
    assert manager.pool.finetune_pages > 0
    backend.reads = 0
    manager.finetune.return_unwanted_budget()
    assert backend.reads == 0
    manager.finetune.set_demand(0)  # now all of it is above the demand: it goes back
    manager.finetune.return_unwanted_budget()
    assert backend.reads > 0
    assert manager.pool.finetune_pages < 60


def _reference_demand(engine: Engine) -> tuple[int, int]:
    """`scheduler_block_demand` as it was, through the block manager's own methods."""
    block_manager = engine.block_manager
    budget = int(engine.config.max_num_batched_tokens)
    running = 0
    scheduler: Any = engine.scheduler
    for request in scheduler.running:
        if budget <= 0:
            break
        count = min(request.num_tokens - request.num_computed_tokens, budget)
        target = request.num_computed_tokens + count
        running += block_manager.num_new_blocks(request.block_table, target)
        budget -= count
    waiting = 0
    for request in scheduler.waiting:
        chunk = min(request.num_tokens - request.num_computed_tokens, max(budget, 1))
        waiting += block_manager.blocks_for_tokens(request.num_computed_tokens + chunk)
        budget -= chunk
    return running, waiting


def test_scheduler_demand_equals_the_block_managers_count_every_step() -> None:
    model = build_random_model(tiny_config("llama"), seed=5)
    engine = Engine(
        model,
        EngineConfig(
            num_kv_blocks=64,
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=24,
            max_model_len=64,
        ),
    )
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 40, (14,), generator=gen).tolist()
    outputs = torch.randint(1, 12, (14,), generator=gen).tolist()
    seen = set()
    for step in range(200):
        if step % 3 == 0 and lengths:
            prompt = torch.randint(1, 480, (lengths.pop(),), generator=gen).tolist()
            params = SamplingParams(
                max_tokens=outputs.pop(), temperature=0.0, ignore_eos=True, detokenize=False
            )
            engine.add_request(prompt, params)
        expected = _reference_demand(engine)
        assert scheduler_block_demand(engine) == expected
        assert scheduler_waiting_blocks(engine) == expected[1]
        seen.add((expected[0] > 0, expected[1] > 0))
        if not engine.has_unfinished_requests() and not lengths:
            break
        engine.step()
    assert seen >= {(True, True), (True, False), (False, False)}
