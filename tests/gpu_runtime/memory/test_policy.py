"""Exact tests of the decode-first policy: watermarks, reclaim, hysteresis, logs, counters."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gpu_runtime.memory import (
    CpuPageBackend,
    DecodeDemand,
    FinetuneBudgetExceeded,
    KVLayout,
    MemoryManager,
    MemoryPolicyConfig,
    MemoryPoolError,
    PagePool,
)

PAGE = 4096
LOGGER = "gpu_runtime.memory.policy"


def _manager(
    num_pages: int = 64, unit: int = 1, tail: int = 0, **config: Any
) -> tuple[MemoryManager, PagePool]:
    pool = PagePool(
        CpuPageBackend(num_pages=num_pages, page_bytes=PAGE, map_unit_pages=unit),
        pinned_tail_pages=tail,
    )
    defaults = {
        "reserve_low_pages": 4,
        "reserve_high_pages": 12,
        "max_step_pages": 4,
        "shrink_after_iterations": 3,
        "grow_hold_iterations": 2,
    }
    cfg = MemoryPolicyConfig(**{**defaults, **config})
    return MemoryManager(pool, KVLayout(page_bytes=PAGE, block_bytes=PAGE), cfg), pool


def _steps(manager: MemoryManager, demand: DecodeDemand, n: int) -> None:
    for _ in range(n):
        manager.before_step(demand)
        manager.maintain(demand)


def test_starts_with_the_low_watermark_mapped_and_refills_in_steps() -> None:
    manager, pool = _manager()
    assert manager.usable_blocks == 4 and pool.free_pages == 60
    # 3 blocks used: free 1 < low 4 -> refill by at most max_step_pages per maintain.
    demand = DecodeDemand(used_blocks=3, top_used_block=3, waiting_blocks=6)
    assert manager.before_step(demand).short_blocks == 0
    manager.maintain(demand)
    assert manager.usable_blocks == 8  # target used 3 + low 4 + waiting 6 = 13: one step of 4
    manager.maintain(demand)
    assert manager.usable_blocks == 12
    manager.maintain(demand)
    assert manager.usable_blocks == 13
    assert manager.counters.refill_maps == 3 and manager.counters.refill_pages == 9
    assert manager.counters.urgent_maps == 0


def test_urgent_need_is_mapped_inline_and_counted() -> None:
    manager, pool = _manager()
    grant = manager.before_step(DecodeDemand(used_blocks=4, top_used_block=4, next_step_blocks=10))
    assert grant.usable_blocks == 14 and grant.short_blocks == 0
    assert manager.counters.urgent_maps == 1 and manager.counters.urgent_pages == 10
    assert len(manager.counters.map_latency) == 2  # initial + urgent
    assert len(manager.counters.reclaim_latency) == 0


def test_decode_reclaims_from_finetuning_before_it_preempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, pool = _manager(num_pages=32, grow_hold_iterations=0)
    manager.set_finetune_demand(24 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    _steps(manager, idle, 6)
    assert pool.finetune_pages == 24 and pool.free_pages == 4
    manager.finetune_quantum_done(peak_bytes=20 * PAGE, resident_bytes=6 * PAGE)
    caplog.set_level(logging.INFO, logger=LOGGER)
    # Burst: 20 blocks next step; 4 mapped + 4 free, so 12 pages come back from finetuning.
    grant = manager.before_step(DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=20))
    assert grant.short_blocks == 0 and grant.usable_blocks == 20
    assert pool.finetune_pages == 12
    assert manager.counters.finetune_shrinks == 1
    assert manager.counters.finetune_reclaimed_pages == 12
    assert len(manager.counters.reclaim_latency) == 1
    assert "finetune budget shrinks 24 -> 12 pages for decode (urgent)" in caplog.text
    assert "decode KV grows 4 -> 20 pages (urgent" in caplog.text
    pool.check()
    # Another burst: finetuning keeps 6 pages of live state; it gives the other 6, then decode
    # preempts for the rest.
    grant = manager.before_step(
        DecodeDemand(used_blocks=20, top_used_block=20, next_step_blocks=12)
    )
    assert pool.finetune_pages == 6 and pool.free_pages == 0
    assert grant.usable_blocks == 26 and grant.short_blocks == 6
    assert manager.counters.preemptions == 1 and manager.counters.preempted_blocks == 6
    assert "decode short of 6 blocks" in caplog.text
    assert manager.finetune_headroom_bytes() == 0


def test_kv_shrinks_only_after_the_hysteresis_and_never_below_used_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, pool = _manager(max_step_pages=8)
    manager.before_step(DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=40))
    assert manager.usable_blocks == 40
    caplog.set_level(logging.INFO, logger=LOGGER)
    low_load = DecodeDemand(used_blocks=5, top_used_block=30)
    manager.maintain(low_load)
    manager.maintain(low_load)
    assert manager.usable_blocks == 40  # two iterations above high: not yet
    manager.maintain(DecodeDemand(used_blocks=30, top_used_block=30))  # load back: count resets
    manager.maintain(low_load)
    manager.maintain(low_load)
    assert manager.usable_blocks == 40
    manager.maintain(low_load)  # third consecutive: give back one step of 8 pages
    assert manager.usable_blocks == 32
    manager.maintain(low_load)  # block 29 is in use: keep [0, 30)
    assert manager.usable_blocks == 30
    assert manager.counters.kv_shrinks == 2 and manager.counters.decode_pages_unmapped == 10
    assert "decode KV shrinks 40 -> 32 pages" in caplog.text
    # Without top_used_block the shrink asks the callable, and needs one of the two.
    calls: list[int] = []

    def top() -> int:
        calls.append(1)
        return 5

    manager.maintain(DecodeDemand(used_blocks=5), top_used_block=top)
    assert calls == [1] and manager.usable_blocks == 22
    with pytest.raises(MemoryPoolError, match="needs top_used_block"):
        manager.maintain(DecodeDemand(used_blocks=5))


def test_finetune_grows_back_with_hysteresis_and_returns_what_it_does_not_want() -> None:
    manager, pool = _manager(num_pages=32, grow_hold_iterations=3)
    manager.set_finetune_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    _steps(manager, idle, 1)
    assert pool.finetune_pages == 12  # lending is a cap change: all idle pages in one move
    manager.before_step(DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=30))
    assert pool.finetune_pages < 12
    reclaimed_to = pool.finetune_pages
    busy = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(busy)
    manager.before_step(busy)
    manager.maintain(busy)
    assert pool.finetune_pages == reclaimed_to  # held for grow_hold_iterations
    assert manager.counters.finetune_grows == 1
    # Demand drops: the unused budget goes back at once (no decode need).
    manager.set_finetune_demand(PAGE)
    manager.maintain(busy)
    assert pool.finetune_pages == 1
    assert manager.counters.finetune_shrinks == 2


def test_budget_above_the_demand_goes_back_without_a_flush_while_a_job_exists() -> None:
    manager, pool = _manager(num_pages=32, grow_hold_iterations=0)
    manager.set_finetune_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(idle)
    assert pool.finetune_pages == 12
    manager.finetune_quantum_done(peak_bytes=10 * PAGE, resident_bytes=PAGE)
    # The job wants less: only the 2 pages its cache does not hold come back (a cap change).
    manager.set_finetune_demand(4 * PAGE)
    for _ in range(3):
        manager.maintain(idle)
    assert pool.finetune_pages == 10 and len(manager.counters.flush_latency) == 0
    # No job: the idle budget goes back with its cache, one step (4 pages) per call.
    manager.set_finetune_demand(0)
    manager.maintain(idle)
    assert pool.finetune_pages == 6 and len(manager.counters.flush_latency) == 1
    assert manager.counters.urgent_flushes == 0
    for _ in range(2):
        manager.maintain(idle)
    assert pool.finetune_pages == 1  # the live state stays until the finetune side frees it


def test_moves_are_whole_map_units() -> None:
    manager, pool = _manager(num_pages=64, unit=4, tail=4, reserve_low_pages=2, max_step_pages=8)
    assert pool.kv_prefix_pages == 4  # low watermark 2 rounded up to a unit
    grant = manager.before_step(DecodeDemand(used_blocks=3, top_used_block=3, next_step_blocks=3))
    assert grant.usable_blocks == 8
    manager.set_finetune_demand(50 * PAGE)
    for _ in range(10):
        manager.maintain(DecodeDemand(used_blocks=3, top_used_block=3))
    assert pool.finetune_pages == 50 and pool.free_pages == 2
    # 9 more blocks: 3 pages short of a unit boundary -> one unit of 4 from 2 free + 2 reclaimed.
    grant = manager.before_step(DecodeDemand(used_blocks=3, top_used_block=3, next_step_blocks=6))
    assert grant.usable_blocks == 12 and pool.finetune_pages == 48 and pool.free_pages == 0
    pool.check()


def test_budget_violations_and_ooms_are_counted() -> None:
    manager, pool = _manager(num_pages=16, grow_hold_iterations=0)
    manager.set_finetune_demand(4 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    with pytest.raises(FinetuneBudgetExceeded):
        manager.finetune_quantum_done(peak_bytes=5 * PAGE, resident_bytes=0)
    manager.record_finetune_oom()
    counters = manager.counters.as_dict()
    assert counters["finetune_budget_violations"] == 1
    assert counters["finetune_ooms"] == 1
    assert counters["finetune_quanta"] == 1
    assert counters["map_count"] == 1
    assert set(counters) >= {"reclaim_ms_p50", "reclaim_ms_p99", "map_ms_p99", "iterations"}


def test_recomputing_launches_and_mode_switches_are_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, _ = _manager(num_pages=16)
    with caplog.at_level(logging.INFO, logger="gpu_runtime.memory.policy"):
        for recompute in (False, False, True, True, False, True):
            manager.finetune_quantum_mode(examples=2, recompute=recompute)
    counters = manager.counters.as_dict()
    assert counters["finetune_recompute_launches"] == 3
    assert counters["finetune_mode_switches"] == 3  # off -> on -> off -> on
    lines = [r.getMessage() for r in caplog.records if "recomputation" in r.getMessage()]
    assert [line.split()[2] for line in lines] == ["start", "stop", "start"]


def test_demands_and_configs_are_validated() -> None:
    manager, _ = _manager()
    with pytest.raises(MemoryPoolError, match="only 4 are mapped"):
        manager.before_step(DecodeDemand(used_blocks=5))
    with pytest.raises(ValueError, match="top_used_block"):
        DecodeDemand(used_blocks=3, top_used_block=2)
    with pytest.raises(ValueError, match="next_step_blocks must be >= 0"):
        DecodeDemand(used_blocks=0, next_step_blocks=-1)
    with pytest.raises(ValueError, match="must exceed"):
        MemoryPolicyConfig(reserve_low_pages=8, reserve_high_pages=8)
    with pytest.raises(ValueError, match="map unit"):
        _manager(num_pages=16, unit=4, max_step_pages=2)
    with pytest.raises(ValueError, match="finetune demand"):
        manager.set_finetune_demand(-1)


def test_refill_defers_reclaims_while_a_finetune_quantum_runs() -> None:
    manager, pool = _manager(num_pages=16, grow_hold_iterations=0, max_step_pages=8)
    manager.set_finetune_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(idle)
    manager.maintain(idle)
    assert pool.finetune_pages == 12 and pool.free_pages == 0
    loaded = DecodeDemand(used_blocks=3, top_used_block=3)  # reserve 1 < low 4
    manager.maintain(loaded, finetune_busy=True)
    assert pool.finetune_pages == 12 and manager.usable_blocks == 4
    assert manager.counters.deferred_reclaims == 1 and manager.counters.finetune_shrinks == 0
    manager.maintain(loaded)  # the quantum ended: now the pages come back
    assert pool.finetune_pages == 9 and manager.usable_blocks == 7
    assert manager.counters.finetune_shrinks == 1


def test_an_urgent_reclaim_waits_for_the_running_quantum_first() -> None:
    manager, pool = _manager(num_pages=16, grow_hold_iterations=0, max_step_pages=8)
    manager.set_finetune_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(idle)
    manager.maintain(idle)
    waits: list[int] = []
    burst = DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=4)
    manager.before_step(burst, finetune_busy=True, wait_for_finetune=lambda: waits.append(1))
    assert waits == []  # the 4 mapped pages suffice: nobody waits
    burst = DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=6)
    grant = manager.before_step(
        burst, finetune_busy=True, wait_for_finetune=lambda: waits.append(1)
    )
    assert waits == [1] and grant.short_blocks == 0 and pool.finetune_pages == 10
    assert manager.counters.finetune_waits == 1 and len(manager.counters.wait_latency) == 1


def test_a_static_split_never_takes_finetune_pages_back() -> None:
    manager, pool = _manager(
        num_pages=16, grow_hold_iterations=0, max_step_pages=8, reclaim_from_finetune=False
    )
    manager.set_finetune_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(idle)
    manager.maintain(idle)
    waits: list[int] = []
    grant = manager.before_step(
        DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=6),
        finetune_busy=True,
        wait_for_finetune=lambda: waits.append(1),
    )
    assert grant.short_blocks == 2 and pool.finetune_pages == 12
    assert manager.counters.preemptions == 1 and manager.counters.finetune_shrinks == 0
    assert waits == [] and manager.counters.finetune_waits == 0  # nothing would come back


def test_between_quanta_the_reserve_is_refilled_from_finetune_without_touching_hysteresis() -> None:
    manager, pool = _manager(
        num_pages=16, grow_hold_iterations=0, max_step_pages=2, shrink_after_iterations=2
    )
    manager.set_finetune_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    for _ in range(6):
        manager.maintain(idle)
    assert pool.finetune_pages == 12 and pool.free_pages == 0
    # 1 of 4 mapped blocks used: free 3 < low 4, so one step reclaims the missing page.
    assert manager.refill_reserve(DecodeDemand(used_blocks=1)) == 1
    assert manager.usable_blocks == 5 and pool.finetune_pages == 11
    assert manager.counters.finetune_shrinks == 1 and len(manager.counters.reclaim_latency) == 1
    assert len(manager.counters.flush_latency) == 0  # the allocator held nothing: no flush
    assert manager.refill_reserve(DecodeDemand(used_blocks=1)) == 0
    assert manager.counters.refill_maps == 1 and manager._iterations_above_high == 0


def test_a_shrink_blocked_by_a_live_top_block_waits_another_hysteresis_period() -> None:
    manager, _ = _manager(max_step_pages=8)
    manager.before_step(DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=40))
    calls: list[int] = []

    def top() -> int:  # block 39 is live: nothing above it can go
        calls.append(1)
        return 40

    for _ in range(7):
        manager.maintain(DecodeDemand(used_blocks=5), top_used_block=top)
    # Asked on the 3rd and 6th iterations above high, not on every one after the 3rd.
    assert len(calls) == 2 and manager.usable_blocks == 40 and manager.counters.kv_shrinks == 0


def test_the_reserve_between_quanta_covers_decode_growth_over_one_quantum() -> None:
    manager, pool = _manager(num_pages=64, grow_hold_iterations=0, max_step_pages=2)
    manager.set_finetune_demand(60 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    for _ in range(30):
        manager.maintain(idle)
    assert pool.finetune_pages == 60 and manager.usable_blocks == 4
    assert manager.refill_reserve(DecodeDemand(used_blocks=0)) == 0  # first call: no interval
    # During the quantum decode grew by 4 blocks (urgent maps from the reclaim path).
    manager.before_step(DecodeDemand(used_blocks=0, next_step_blocks=4))
    # Next point: 4 used, low 4, plus the 4 it grew by -> 12 mapped, in one move (no step cap).
    assert manager.refill_reserve(DecodeDemand(used_blocks=4)) == 8
    assert manager.usable_blocks == 12 and pool.finetune_pages == 52
    # Growth is remembered over `growth_window` intervals (the largest counts).
    for used in (5, 5, 5):
        manager.refill_reserve(DecodeDemand(used_blocks=used))
    assert manager.usable_blocks == 13  # 5 + 4 + 4
    manager.refill_reserve(DecodeDemand(used_blocks=5))  # the 4-block interval left the window
    assert manager.usable_blocks == 13 and manager.refill_reserve(DecodeDemand(used_blocks=5)) == 0
    with pytest.raises(ValueError, match="growth_window"):
        MemoryPolicyConfig(growth_window=0)


def test_idle_pages_are_lent_while_decode_grows_keeping_what_its_reserve_lacks() -> None:
    manager, pool = _manager(num_pages=64, grow_hold_iterations=0, max_step_pages=2)
    manager.set_finetune_demand(64 * PAGE)
    # Decode is below its low watermark (a long queue): it refills by one step of 2 pages, and
    # every free page beyond the 6 its reserve still lacks (4 used + low 4 + waiting 4 = 12
    # blocks, 6 mapped) goes to finetuning at once.
    manager.maintain(DecodeDemand(used_blocks=4, top_used_block=4, waiting_blocks=4))
    assert manager.usable_blocks == 6
    assert pool.free_pages == 6 and pool.finetune_pages == 52
    assert manager.counters.finetune_grows == 1


def test_quanta_planned_below_the_reclaim_headroom_make_most_reclaims_flush_free() -> None:
    def run(intervals: int) -> tuple[list[int], int, MemoryManager]:
        manager, pool = _manager(
            num_pages=64, grow_hold_iterations=0, plan_headroom_intervals=intervals
        )
        manager.set_finetune_demand(60 * PAGE)
        idle = DecodeDemand(used_blocks=0, top_used_block=0)
        for _ in range(20):
            manager.maintain(idle)
        assert pool.finetune_pages == 60 and manager.usable_blocks == 4
        plans = []
        used = 0
        manager.refill_reserve(DecodeDemand(used_blocks=used))
        for _ in range(6):  # decode grows 2 blocks per interval between quanta
            plans.append(manager.finetune_plan_bytes() // PAGE)
            # The quantum fills what it was told to plan for (live state: 1 page); the
            # simulated caching allocator keeps its largest peak until a flush.
            manager.finetune_quantum_done(
                peak_bytes=manager.finetune_plan_bytes(), resident_bytes=PAGE
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
    assert manager.reclaim_headroom_pages() == 6
    # A static split never reclaims: nothing is held back.
    manager, pool = _manager(num_pages=16, grow_hold_iterations=0, reclaim_from_finetune=False)
    manager.set_finetune_demand(12 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert manager.reclaim_headroom_pages() == 0
    assert manager.finetune_plan_bytes() == pool.finetune_budget_bytes > 0
    with pytest.raises(ValueError, match="plan_headroom_intervals"):
        MemoryPolicyConfig(plan_headroom_intervals=-1)


def test_while_a_quantum_runs_decode_takes_the_budget_it_was_not_promised_without_waiting() -> None:
    manager, pool = _manager(num_pages=32, grow_hold_iterations=0, max_step_pages=8)
    manager.set_finetune_demand(28 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(idle)
    assert pool.finetune_pages == 28 and pool.free_pages == 0
    # The running quantum was promised 20 pages and its allocator holds 12 (live 2): 8 spare.
    manager.finetune_quantum_done(peak_bytes=12 * PAGE, resident_bytes=2 * PAGE)
    assert manager.busy_spare_pages(20 * PAGE) == 8
    assert manager.busy_spare_pages(None) == 0  # no promise known: the whole budget is its
    assert manager.busy_spare_pages(4 * PAGE) == 16  # the allocator's 12 pages stay
    waits: list[int] = []
    burst = DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=10)
    grant = manager.before_step(
        burst,
        finetune_busy=True,
        wait_for_finetune=lambda: waits.append(1),
        promised_bytes=20 * PAGE,
    )
    # 6 more pages (10 blocks, 4 mapped) come from the spare 8: a cap change, no flush.
    assert waits == [] and grant.short_blocks == 0 and manager.usable_blocks == 10
    assert pool.finetune_pages == 22 and manager.counters.busy_reclaims == 1
    assert len(manager.counters.flush_latency) == 0 and manager.counters.finetune_waits == 0
    pool.check()
    # Beyond the spare (2 pages left) it still waits for the quantum.
    burst = DecodeDemand(used_blocks=10, top_used_block=10, next_step_blocks=6)
    manager.before_step(
        burst,
        finetune_busy=True,
        wait_for_finetune=lambda: waits.append(1),
        promised_bytes=20 * PAGE,
    )
    assert waits == [1] and manager.counters.finetune_waits == 1
    assert manager.usable_blocks == 16 and pool.finetune_pages == 16
    # The reserve refill during a quantum takes the spare too, and defers the rest.
    manager, pool = _manager(num_pages=32, grow_hold_iterations=0, max_step_pages=8)
    manager.set_finetune_demand(28 * PAGE)
    manager.maintain(idle)
    manager.finetune_quantum_done(peak_bytes=12 * PAGE, resident_bytes=2 * PAGE)
    loaded = DecodeDemand(used_blocks=4, top_used_block=4, waiting_blocks=8)  # wants 12 more
    manager.maintain(loaded, finetune_busy=True, promised_bytes=24 * PAGE)
    assert manager.usable_blocks == 8 and pool.finetune_pages == 24  # spare 4 pages taken
    assert manager.counters.deferred_reclaims == 1 and len(manager.counters.flush_latency) == 0
    pool.check()


def test_the_plan_headroom_remembers_a_burst_over_a_quiet_spell_and_has_a_floor() -> None:
    def manager_for(**config: Any) -> tuple[MemoryManager, PagePool]:
        manager, pool = _manager(num_pages=64, grow_hold_iterations=0, **config)
        manager.set_finetune_demand(60 * PAGE)
        for _ in range(20):
            manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
        return manager, pool

    # Before any growth is seen, the floor (less decode's free pages: none) is kept out.
    manager, pool = manager_for(plan_headroom_intervals=1, plan_headroom_min_pages=6)
    assert pool.free_pages == 0 and manager.reclaim_headroom_pages() == 6
    assert manager.finetune_plan_bytes() == (pool.finetune_pages - 6) * PAGE
    # A burst of 5 blocks in one interval, then 8 quiet intervals: the burst is still
    # remembered (headroom_window 64), though it left the 4-interval growth_window.
    manager.refill_reserve(DecodeDemand(used_blocks=0))
    manager.before_step(DecodeDemand(used_blocks=0, next_step_blocks=5))
    manager.refill_reserve(DecodeDemand(used_blocks=5))
    for _ in range(8):
        manager.refill_reserve(DecodeDemand(used_blocks=5))
    assert manager.reclaim_headroom_pages() == 6  # max(5 pages of growth, floor 6)
    manager, pool = manager_for(plan_headroom_intervals=2, headroom_window=4)
    manager.refill_reserve(DecodeDemand(used_blocks=0))
    manager.before_step(DecodeDemand(used_blocks=0, next_step_blocks=5))
    manager.refill_reserve(DecodeDemand(used_blocks=5))
    assert manager.reclaim_headroom_pages() == 10  # 2 intervals of 5 blocks
    for _ in range(4):
        manager.refill_reserve(DecodeDemand(used_blocks=5))
    assert manager.reclaim_headroom_pages() == 0  # a short window forgot the burst
    with pytest.raises(ValueError, match="headroom_window"):
        MemoryPolicyConfig(headroom_window=0)
    with pytest.raises(ValueError, match="plan_headroom_min_pages"):
        MemoryPolicyConfig(plan_headroom_min_pages=-1)


def test_with_a_peak_window_quanta_are_planned_beside_decodes_recent_peak() -> None:
    manager, pool = _manager(
        num_pages=64, grow_hold_iterations=0, plan_peak_window=3, plan_peak_prior_blocks=20
    )
    manager.set_finetune_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert pool.finetune_pages == 60 and manager.usable_blocks == 4
    # The prior peak (20 blocks) plus the low watermark (4) is 24 pages; 4 are mapped, none
    # free: quanta plan for 40 of the 60 pages lent.
    assert manager.reclaim_headroom_pages() == 20
    assert manager.finetune_plan_bytes() == 40 * PAGE
    plans = []
    for _ in range(3):  # decode stays at 2 blocks; the prior ages out after 3 boundaries
        manager.refill_reserve(DecodeDemand(used_blocks=2))
        plans.append(manager.finetune_plan_bytes() // PAGE)
    assert manager.usable_blocks == 6 and pool.finetune_pages == 58
    assert plans == [40, 40, 58]
    # Off by default: only the growth and the floor count.
    manager, pool = _manager(num_pages=64, grow_hold_iterations=0, plan_peak_prior_blocks=20)
    manager.set_finetune_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert manager.reclaim_headroom_pages() == 0
    with pytest.raises(ValueError, match="plan_peak_window"):
        MemoryPolicyConfig(plan_peak_window=-1)


def test_the_plan_never_falls_below_what_finetune_already_holds_within_its_budget() -> None:
    # The peak term keeps 20 pages out of the plan; the allocator then holds 30 pages (a
    # graph pool captured in a quiet spell): planning below them frees nothing without a
    # flush, so the plan is what is held while that is within the budget.
    manager, pool = _manager(
        num_pages=64, grow_hold_iterations=0, plan_peak_window=3, plan_peak_prior_blocks=20
    )
    manager.set_finetune_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert manager.finetune_plan_bytes() == 40 * PAGE
    manager.finetune_quantum_done(peak_bytes=45 * PAGE, resident_bytes=2 * PAGE)
    assert pool.backend.finetune_reserved_bytes() == 45 * PAGE
    assert manager.reclaim_headroom_pages() == 20  # decode's expected reclaims: unchanged
    assert manager.finetune_plan_bytes() == 45 * PAGE
    # Decode takes back the 15 pages beyond what is held (a cap change): the plan stays at
    # what is held, the budget.
    manager.before_step(DecodeDemand(used_blocks=4, next_step_blocks=15))
    assert pool.finetune_pages == 45 and len(manager.counters.flush_latency) == 0
    assert manager.finetune_plan_bytes() == 45 * PAGE
    # Decode needs more: the urgent reclaim flushes (the cache goes), and the plan is the
    # budget less the headroom again.
    manager.before_step(DecodeDemand(used_blocks=19, next_step_blocks=4))
    assert len(manager.counters.flush_latency) == 1
    assert pool.backend.finetune_reserved_bytes() == 2 * PAGE
    plan = manager.finetune_plan_bytes() // PAGE
    assert plan == pool.finetune_pages - manager.reclaim_headroom_pages() < pool.finetune_pages
    # Under a static split nothing is kept out: the plan is the budget.
    manager, pool = _manager(num_pages=64, grow_hold_iterations=0, reclaim_from_finetune=False)
    manager.set_finetune_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    manager.finetune_quantum_done(peak_bytes=10 * PAGE, resident_bytes=PAGE)
    assert manager.finetune_plan_bytes() == pool.finetune_budget_bytes == 60 * PAGE
