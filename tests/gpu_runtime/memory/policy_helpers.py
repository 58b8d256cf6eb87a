"""Shared set-up of the decode-first policy tests (``test_policy*.py``): a small CPU pool."""

from __future__ import annotations

from typing import Any

from gpu_runtime.memory import (
    CpuPageBackend,
    DecodeDemand,
    KVLayout,
    MemoryManager,
    MemoryManagerConfig,
    PagePool,
)

PAGE = 4096
LOGGER = "gpu_runtime.memory"


def policy_manager(
    num_pages: int = 64, unit: int = 1, tail: int = 0, **config: Any
) -> tuple[MemoryManager, PagePool]:
    """A manager over ``num_pages`` CPU pages of ``PAGE`` bytes (one block a page), with small
    watermarks and hysteresis; ``config`` overrides any ``MemoryManagerConfig`` field."""
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
    cfg = MemoryManagerConfig(**{**defaults, **config})
    return MemoryManager(pool, KVLayout(page_bytes=PAGE, block_bytes=PAGE), cfg), pool


def run_steps(manager: MemoryManager, demand: DecodeDemand, n: int) -> None:
    """``n`` iterations of ``before_step`` then ``maintain`` at the same demand."""
    for _ in range(n):
        manager.before_step(demand)
        manager.maintain(demand)
