"""Exact tests of the decode-first policy, finetune side: lending idle pages, reclaiming them
for decode (urgent, deferred, waiting for or beside a running quantum), the static split,
and the reserve refilled between quanta."""

from __future__ import annotations

import logging

import pytest

from gpu_runtime.memory import DecodeDemand, MemoryManagerConfig
from tests.gpu_runtime.memory.policy_helpers import LOGGER, PAGE, policy_manager, run_steps


def test_decode_reclaims_from_finetuning_before_it_preempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, pool = policy_manager(num_pages=32, grow_hold_iterations=0)
    manager.finetune.set_demand(24 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    run_steps(manager, idle, 6)
    assert pool.finetune_pages == 24 and pool.free_pages == 4
    manager.finetune.quantum_done(peak_bytes=20 * PAGE, resident_bytes=6 * PAGE)
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
    assert manager.finetune.headroom_bytes() == 0


def test_finetune_grows_back_with_hysteresis_and_returns_what_it_does_not_want() -> None:
    manager, pool = policy_manager(num_pages=32, grow_hold_iterations=3)
    manager.finetune.set_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    run_steps(manager, idle, 1)
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
    manager.finetune.set_demand(PAGE)
    manager.maintain(busy)
    assert pool.finetune_pages == 1
    assert manager.counters.finetune_shrinks == 2


def test_budget_above_the_demand_goes_back_without_a_flush_while_a_job_exists() -> None:
    manager, pool = policy_manager(num_pages=32, grow_hold_iterations=0)
    manager.finetune.set_demand(12 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(idle)
    assert pool.finetune_pages == 12
    manager.finetune.quantum_done(peak_bytes=10 * PAGE, resident_bytes=PAGE)
    # The job wants less: only the 2 pages its cache does not hold come back (a cap change).
    manager.finetune.set_demand(4 * PAGE)
    for _ in range(3):
        manager.maintain(idle)
    assert pool.finetune_pages == 10 and len(manager.counters.flush_latency) == 0
    # No job: the idle budget goes back with its cache, one step (4 pages) per call.
    manager.finetune.set_demand(0)
    manager.maintain(idle)
    assert pool.finetune_pages == 6 and len(manager.counters.flush_latency) == 1
    assert manager.counters.urgent_flushes == 0
    for _ in range(2):
        manager.maintain(idle)
    assert pool.finetune_pages == 1  # the live state stays until the finetune side frees it


def test_refill_defers_reclaims_while_a_finetune_quantum_runs() -> None:
    manager, pool = policy_manager(num_pages=16, grow_hold_iterations=0, max_step_pages=8)
    manager.finetune.set_demand(12 * PAGE)
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
    manager, pool = policy_manager(num_pages=16, grow_hold_iterations=0, max_step_pages=8)
    manager.finetune.set_demand(12 * PAGE)
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
    manager, pool = policy_manager(
        num_pages=16, grow_hold_iterations=0, max_step_pages=8, reclaim_from_finetune=False
    )
    manager.finetune.set_demand(12 * PAGE)
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
    manager, pool = policy_manager(
        num_pages=16, grow_hold_iterations=0, max_step_pages=2, shrink_after_iterations=2
    )
    manager.finetune.set_demand(12 * PAGE)
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


def test_the_reserve_between_quanta_covers_decode_growth_over_one_quantum() -> None:
    manager, pool = policy_manager(num_pages=64, grow_hold_iterations=0, max_step_pages=2)
    manager.finetune.set_demand(60 * PAGE)
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
        MemoryManagerConfig(growth_window=0)


def test_idle_pages_are_lent_while_decode_grows_keeping_what_its_reserve_lacks() -> None:
    manager, pool = policy_manager(num_pages=64, grow_hold_iterations=0, max_step_pages=2)
    manager.finetune.set_demand(64 * PAGE)
    # Decode is below its low watermark (a long queue): it refills by one step of 2 pages, and
    # every free page beyond the 6 its reserve still lacks (4 used + low 4 + waiting 4 = 12
    # blocks, 6 mapped) goes to finetuning at once.
    manager.maintain(DecodeDemand(used_blocks=4, top_used_block=4, waiting_blocks=4))
    assert manager.usable_blocks == 6
    assert pool.free_pages == 6 and pool.finetune_pages == 52
    assert manager.counters.finetune_grows == 1


def test_while_a_quantum_runs_decode_takes_the_budget_it_was_not_promised_without_waiting() -> None:
    manager, pool = policy_manager(num_pages=32, grow_hold_iterations=0, max_step_pages=8)
    manager.finetune.set_demand(28 * PAGE)
    idle = DecodeDemand(used_blocks=0, top_used_block=0)
    manager.maintain(idle)
    assert pool.finetune_pages == 28 and pool.free_pages == 0
    # The running quantum was promised 20 pages and its allocator holds 12 (live 2): 8 spare.
    manager.finetune.quantum_done(peak_bytes=12 * PAGE, resident_bytes=2 * PAGE)
    assert manager.finetune.busy_spare_pages(20 * PAGE) == 8
    assert manager.finetune.busy_spare_pages(None) == 0  # no promise known: the whole budget is its
    assert manager.finetune.busy_spare_pages(4 * PAGE) == 16  # the allocator's 12 pages stay
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
    manager, pool = policy_manager(num_pages=32, grow_hold_iterations=0, max_step_pages=8)
    manager.finetune.set_demand(28 * PAGE)
    manager.maintain(idle)
    manager.finetune.quantum_done(peak_bytes=12 * PAGE, resident_bytes=2 * PAGE)
    loaded = DecodeDemand(used_blocks=4, top_used_block=4, waiting_blocks=8)  # wants 12 more
    manager.maintain(loaded, finetune_busy=True, promised_bytes=24 * PAGE)
    assert manager.usable_blocks == 8 and pool.finetune_pages == 24  # spare 4 pages taken
    assert manager.counters.deferred_reclaims == 1 and len(manager.counters.flush_latency) == 0
    pool.check()
