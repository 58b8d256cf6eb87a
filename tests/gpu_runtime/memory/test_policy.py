"""Exact tests of the decode-first policy, decode side: watermarks, refills, urgent maps,
KV shrink hysteresis, map units, validation, counters and logs.

Finetune reclaim and lending: ``test_policy_reclaim``; quantum plans: ``test_policy_plan``."""

from __future__ import annotations

import logging

import pytest

from gpu_runtime.memory import (
    DecodeDemand,
    FinetuneBudgetExceeded,
    MemoryManagerConfig,
    MemoryPoolError,
)
from tests.gpu_runtime.memory.policy_helpers import LOGGER, PAGE, policy_manager


def test_starts_with_the_low_watermark_mapped_and_refills_in_steps() -> None:
    manager, pool = policy_manager()
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
    manager, pool = policy_manager()
    grant = manager.before_step(DecodeDemand(used_blocks=4, top_used_block=4, next_step_blocks=10))
    assert grant.usable_blocks == 14 and grant.short_blocks == 0
    assert manager.counters.urgent_maps == 1 and manager.counters.urgent_pages == 10
    assert len(manager.counters.map_latency) == 2  # initial + urgent
    assert len(manager.counters.reclaim_latency) == 0


def test_kv_shrinks_only_after_the_hysteresis_and_never_below_used_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, pool = policy_manager(max_step_pages=8)
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


def test_moves_are_whole_map_units() -> None:
    manager, pool = policy_manager(
        num_pages=64, unit=4, tail=4, reserve_low_pages=2, max_step_pages=8
    )
    assert pool.kv_prefix_pages == 4  # low watermark 2 rounded up to a unit
    grant = manager.before_step(DecodeDemand(used_blocks=3, top_used_block=3, next_step_blocks=3))
    assert grant.usable_blocks == 8
    manager.finetune.set_demand(50 * PAGE)
    for _ in range(10):
        manager.maintain(DecodeDemand(used_blocks=3, top_used_block=3))
    assert pool.finetune_pages == 50 and pool.free_pages == 2
    # 9 more blocks: 3 pages short of a unit boundary -> one unit of 4 from 2 free + 2 reclaimed.
    grant = manager.before_step(DecodeDemand(used_blocks=3, top_used_block=3, next_step_blocks=6))
    assert grant.usable_blocks == 12 and pool.finetune_pages == 48 and pool.free_pages == 0
    pool.check()


def test_budget_violations_and_ooms_are_counted() -> None:
    manager, pool = policy_manager(num_pages=16, grow_hold_iterations=0)
    manager.finetune.set_demand(4 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    with pytest.raises(FinetuneBudgetExceeded):
        manager.finetune.quantum_done(peak_bytes=5 * PAGE, resident_bytes=0)
    manager.finetune.record_oom()
    counters = manager.counters.as_dict()
    assert counters["finetune_budget_violations"] == 1
    assert counters["finetune_ooms"] == 1
    assert counters["finetune_quanta"] == 1
    assert counters["map_count"] == 1
    assert set(counters) >= {"reclaim_ms_p50", "reclaim_ms_p99", "map_ms_p99", "iterations"}


def test_recomputing_launches_and_mode_switches_are_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, _ = policy_manager(num_pages=16)
    with caplog.at_level(logging.INFO, logger="gpu_runtime.memory"):
        for recompute in (False, False, True, True, False, True):
            manager.finetune.quantum_mode(examples=2, recompute=recompute)
    counters = manager.counters.as_dict()
    assert counters["finetune_recompute_launches"] == 3
    assert counters["finetune_mode_switches"] == 3  # off -> on -> off -> on
    lines = [r.getMessage() for r in caplog.records if "recomputation" in r.getMessage()]
    assert [line.split()[2] for line in lines] == ["start", "stop", "start"]


def test_demands_and_configs_are_validated() -> None:
    manager, _ = policy_manager()
    with pytest.raises(MemoryPoolError, match="only 4 are mapped"):
        manager.before_step(DecodeDemand(used_blocks=5))
    with pytest.raises(ValueError, match="top_used_block"):
        DecodeDemand(used_blocks=3, top_used_block=2)
    with pytest.raises(ValueError, match="next_step_blocks must be >= 0"):
        DecodeDemand(used_blocks=0, next_step_blocks=-1)
    with pytest.raises(ValueError, match="must exceed"):
        MemoryManagerConfig(reserve_low_pages=8, reserve_high_pages=8)
    with pytest.raises(ValueError, match="map unit"):
        policy_manager(num_pages=16, unit=4, max_step_pages=2)
    with pytest.raises(ValueError, match="finetune demand"):
        manager.finetune.set_demand(-1)


def test_a_shrink_blocked_by_a_live_top_block_waits_another_hysteresis_period() -> None:
    manager, _ = policy_manager(max_step_pages=8)
    manager.before_step(DecodeDemand(used_blocks=0, top_used_block=0, next_step_blocks=40))
    calls: list[int] = []

    def top() -> int:  # block 39 is live: nothing above it can go
        calls.append(1)
        return 40

    for _ in range(7):
        manager.maintain(DecodeDemand(used_blocks=5), top_used_block=top)
    # Asked on the 3rd and 6th iterations above high, not on every one after the 3rd.
    assert len(calls) == 2 and manager.usable_blocks == 40 and manager.counters.kv_shrinks == 0
