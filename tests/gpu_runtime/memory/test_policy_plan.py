"""Exact tests of the decode-first policy's quantum plans: the reclaim headroom kept out of
what a finetune quantum plans for (growth, floor, decode's recent peak, what is held)."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_runtime.memory import DecodeDemand, MemoryManager, MemoryManagerConfig, PagePool
from tests.gpu_runtime.memory.policy_helpers import PAGE, policy_manager


def test_quanta_planned_below_the_reclaim_headroom_make_most_reclaims_flush_free() -> None:
    def run(intervals: int) -> tuple[list[int], int, MemoryManager]:
        manager, pool = policy_manager(
            num_pages=64, grow_hold_iterations=0, plan_headroom_intervals=intervals
        )
        manager.finetune.set_demand(60 * PAGE)
        idle = DecodeDemand(used_blocks=0, top_used_block=0)
        for _ in range(20):
            manager.maintain(idle)
        assert pool.finetune_pages == 60 and manager.usable_blocks == 4
        plans = []
        used = 0
        manager.refill_reserve(DecodeDemand(used_blocks=used))
        for _ in range(6):  # decode grows 2 blocks per interval between quanta
            plans.append(manager.finetune.plan_bytes() // PAGE)
            # The quantum fills what it was told to plan for (live state: 1 page); the
            # simulated caching allocator keeps its largest peak until a flush.
            manager.finetune.quantum_done(
                peak_bytes=manager.finetune.plan_bytes(), resident_bytes=PAGE
            )
            manager.before_step(DecodeDemand(used_blocks=used, next_step_blocks=2))
            used += 2
            manager.refill_reserve(DecodeDemand(used_blocks=used))
            pool.check()
        return plans, len(manager.counters.flush_latency), manager

    # Sized to the whole budget, the cache always holds the whole budget: the refills between
    # quanta never flush (each is deferred, counted), and the one flush comes when the step
    # itself needs a page beyond the reserve (urgent, 3rd interval); it empties the cache, so
    # that iteration's refill also takes the reserve's growth (8 pages) by cap changes.
    plans, flushes, manager = run(0)
    assert plans == [60, 60, 60, 52, 52, 52] and flushes == 1
    counters = manager.counters
    assert counters.urgent_flushes == 1 and counters.deferred_flushes == 5
    assert counters.finetune_shrinks == 2
    # Planned below 3 intervals of the largest growth (6 pages): the same first flush (no
    # growth seen yet, no headroom: the cache holds all 60 pages, and until that flush the
    # plan is what it holds, since planning below it would free nothing), then the cache sits
    # 6 pages under the budget and every later reclaim of 2 pages is a cap change; the
    # quanta keep planning for the 46 pages held (the budget less the headroom is 44, 42).
    plans, flushes, manager = run(3)
    assert plans == [60, 60, 60, 46, 46, 46] and flushes == 1
    assert manager.counters.urgent_flushes == 1 and manager.counters.finetune_shrinks == 5
    assert manager.finetune.reclaim_headroom_pages() == 6
    # A static split never reclaims: nothing is held back.
    manager, pool = policy_manager(
        num_pages=16, grow_hold_iterations=0, reclaim_from_finetune=False
    )
    manager.finetune.set_demand(12 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert manager.finetune.reclaim_headroom_pages() == 0
    assert manager.finetune.plan_bytes() == pool.finetune_budget_bytes > 0
    with pytest.raises(ValueError, match="plan_headroom_intervals"):
        MemoryManagerConfig(plan_headroom_intervals=-1)


def test_the_plan_headroom_remembers_a_burst_over_a_quiet_spell_and_has_a_floor() -> None:
    def manager_for(**config: Any) -> tuple[MemoryManager, PagePool]:
        manager, pool = policy_manager(num_pages=64, grow_hold_iterations=0, **config)
        manager.finetune.set_demand(60 * PAGE)
        for _ in range(20):
            manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
        return manager, pool

    # Before any growth is seen, the floor (less decode's free pages: none) is kept out.
    manager, pool = manager_for(plan_headroom_intervals=1, plan_headroom_min_pages=6)
    assert pool.free_pages == 0 and manager.finetune.reclaim_headroom_pages() == 6
    assert manager.finetune.plan_bytes() == (pool.finetune_pages - 6) * PAGE
    # A burst of 5 blocks in one interval, then 8 quiet intervals: the burst is still
    # remembered (headroom_window 64), though it left the 4-interval growth_window.
    manager.refill_reserve(DecodeDemand(used_blocks=0))
    manager.before_step(DecodeDemand(used_blocks=0, next_step_blocks=5))
    manager.refill_reserve(DecodeDemand(used_blocks=5))
    for _ in range(8):
        manager.refill_reserve(DecodeDemand(used_blocks=5))
    assert manager.finetune.reclaim_headroom_pages() == 6  # max(5 pages of growth, floor 6)
    manager, pool = manager_for(plan_headroom_intervals=2, headroom_window=4)
    manager.refill_reserve(DecodeDemand(used_blocks=0))
    manager.before_step(DecodeDemand(used_blocks=0, next_step_blocks=5))
    manager.refill_reserve(DecodeDemand(used_blocks=5))
    assert manager.finetune.reclaim_headroom_pages() == 10  # 2 intervals of 5 blocks
    for _ in range(4):
        manager.refill_reserve(DecodeDemand(used_blocks=5))
    assert manager.finetune.reclaim_headroom_pages() == 0  # a short window forgot the burst
    with pytest.raises(ValueError, match="headroom_window"):
        MemoryManagerConfig(headroom_window=0)
    with pytest.raises(ValueError, match="plan_headroom_min_pages"):
        MemoryManagerConfig(plan_headroom_min_pages=-1)


def test_with_a_peak_window_quanta_are_planned_beside_decodes_recent_peak() -> None:
    manager, pool = policy_manager(
        num_pages=64, grow_hold_iterations=0, plan_peak_window=3, plan_peak_prior_blocks=20
    )
    manager.finetune.set_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert pool.finetune_pages == 60 and manager.usable_blocks == 4
    # The prior peak (20 blocks) plus the low watermark (4) is 24 pages; 4 are mapped, none
    # free: quanta plan for 40 of the 60 pages lent.
    assert manager.finetune.reclaim_headroom_pages() == 20
    assert manager.finetune.plan_bytes() == 40 * PAGE
    plans = []
    for _ in range(3):  # decode stays at 2 blocks; the prior ages out after 3 boundaries
        manager.refill_reserve(DecodeDemand(used_blocks=2))
        plans.append(manager.finetune.plan_bytes() // PAGE)
    assert manager.usable_blocks == 6 and pool.finetune_pages == 58
    assert plans == [40, 40, 58]
    # Off by default: only the growth and the floor count.
    manager, pool = policy_manager(num_pages=64, grow_hold_iterations=0, plan_peak_prior_blocks=20)
    manager.finetune.set_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert manager.finetune.reclaim_headroom_pages() == 0
    with pytest.raises(ValueError, match="plan_peak_window"):
        MemoryManagerConfig(plan_peak_window=-1)


def test_the_plan_never_falls_below_what_finetune_already_holds_within_its_budget() -> None:
    # The peak term keeps 20 pages out of the plan; the allocator then holds 30 pages (a
    # graph pool captured in a quiet spell): planning below them frees nothing without a
    # flush, so the plan is what is held while that is within the budget.
    manager, pool = policy_manager(
        num_pages=64, grow_hold_iterations=0, plan_peak_window=3, plan_peak_prior_blocks=20
    )
    manager.finetune.set_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert manager.finetune.plan_bytes() == 40 * PAGE
    manager.finetune.quantum_done(peak_bytes=45 * PAGE, resident_bytes=2 * PAGE)
    assert pool.backend.finetune_reserved_bytes() == 45 * PAGE
    assert manager.finetune.reclaim_headroom_pages() == 20  # decode's expected reclaims: unchanged
    assert manager.finetune.plan_bytes() == 45 * PAGE
    # Decode takes back the 15 pages beyond what is held (a cap change): the plan stays at
    # what is held, the budget.
    manager.before_step(DecodeDemand(used_blocks=4, next_step_blocks=15))
    assert pool.finetune_pages == 45 and len(manager.counters.flush_latency) == 0
    assert manager.finetune.plan_bytes() == 45 * PAGE
    # Decode needs more: the urgent reclaim flushes (the cache goes), and the plan is the
    # budget less the headroom again.
    manager.before_step(DecodeDemand(used_blocks=19, next_step_blocks=4))
    assert len(manager.counters.flush_latency) == 1
    assert pool.backend.finetune_reserved_bytes() == 2 * PAGE
    plan = manager.finetune.plan_bytes() // PAGE
    assert (
        plan
        == pool.finetune_pages - manager.finetune.reclaim_headroom_pages()
        < pool.finetune_pages
    )
    # Under a static split nothing is kept out: the plan is the budget.
    manager, pool = policy_manager(
        num_pages=64, grow_hold_iterations=0, reclaim_from_finetune=False
    )
    manager.finetune.set_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    manager.finetune.quantum_done(peak_bytes=10 * PAGE, resident_bytes=PAGE)
    assert manager.finetune.plan_bytes() == pool.finetune_budget_bytes == 60 * PAGE
