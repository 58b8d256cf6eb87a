"""`FinetunePools` over a fake allocator: which segments are finetune's, and when it looks again."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from gpu_runtime.memory.torch_pools import FinetunePools, allocator_counters

MIB = 1 << 20


class FakeAllocator:
    """Segments tagged with their pool, cumulative segment counters, a MemPool class."""

    def __init__(self) -> None:
        self.segments: list[dict[str, Any]] = []
        self.created = 0
        self.freed = 0
        self.snapshots = 0
        self.routed: list[tuple[int, int]] = []
        self.next_pool = 1
        allocator = self

        class MemPool:
            def __init__(self) -> None:
                self.id = (allocator.next_pool, 0)
                allocator.next_pool += 1

        @contextlib.contextmanager
        def use_mem_pool(pool: Any, device: int) -> Iterator[None]:
            self.routed.append(pool.id)
            yield
            self.routed.pop()

        self.cuda = SimpleNamespace(
            memory_snapshot=self.snapshot,
            memory_stats_as_nested_dict=self.stats,
            MemPool=MemPool,
            use_mem_pool=use_mem_pool,
        )

    def add(self, pool: tuple[int, int], nbytes: int) -> None:
        self.segments.append({"device": 0, "segment_pool_id": pool, "total_size": nbytes})
        self.created += 1

    def free_pool(self, pool: tuple[int, int]) -> None:
        kept = [s for s in self.segments if s["segment_pool_id"] != pool]
        self.freed += len(self.segments) - len(kept)
        self.segments = kept

    def snapshot(self) -> list[dict[str, Any]]:
        self.snapshots += 1
        return [dict(s) for s in self.segments]

    def stats(self, device: int) -> dict[str, Any]:
        reserved = sum(s["total_size"] for s in self.segments)
        current = self.created - self.freed
        return {
            "segment": {
                "all": {"allocated": self.created, "freed": self.freed, "current": current}
            },
            "reserved_bytes": {"all": {"current": reserved}},
            "num_device_alloc": self.created,
            "num_device_free": self.freed,
            "num_sync_all_streams": 2,
        }


def test_private_pools_created_after_the_baseline_are_finetunes_and_decode_growth_is_not() -> None:
    fake = FakeAllocator()
    fake.add((0, 0), 100 * MIB)  # weights, decode buffers
    fake.add((0, 7), 20 * MIB)  # decode's CUDA graphs, captured before the baseline
    pools = FinetunePools(fake, 0)
    assert pools.available
    pools.reset_baseline()
    assert pools.refresh() == (0, 120 * MIB)
    fake.add((0, 0), 30 * MIB)  # decode's eager prefill grows the default pool
    fake.add((0, 9), 40 * MIB)  # a trainer's graph pool
    with pools.allocations():
        assert fake.routed == [pools.mempool.id]
        fake.add(pools.mempool.id, 8 * MIB)  # adapters, optimizer state
    assert fake.routed == []
    assert pools.refresh() == (48 * MIB, 198 * MIB)
    # No segment came or went: the cached figure, no snapshot.
    taken = fake.snapshots
    assert pools.finetune_reserved_bytes() == 48 * MIB and fake.snapshots == taken
    fake.free_pool((0, 9))  # the graphs dropped and flushed
    assert pools.finetune_reserved_bytes() == 8 * MIB and fake.snapshots == taken + 1
    # A new baseline keeps the finetune MemPool finetune's.
    pools.reset_baseline()
    assert pools.finetune_reserved_bytes() == 8 * MIB


def test_without_pool_ids_in_snapshots_the_pools_are_not_available() -> None:
    fake = FakeAllocator()
    fake.segments.append({"device": 0, "total_size": MIB})
    assert not FinetunePools(fake, 0).available


def test_allocator_counters_are_read_with_every_refresh() -> None:
    fake = FakeAllocator()
    fake.add((0, 0), 100 * MIB)
    pools = FinetunePools(fake, 0)
    pools.reset_baseline()
    assert pools.last_counters == {}  # nothing refreshed yet
    pools.refresh()
    fake.add((0, 9), 40 * MIB)
    fake.free_pool((0, 0))
    pools.refresh()
    assert pools.last_counters == {
        "segments": 1,
        "reserved_bytes": 40 * MIB,
        "device_allocs": 2,
        "device_frees": 1,
        "alloc_retries": 0,  # not in this allocator's stats
        "sync_all_streams": 2,
        "ooms": 0,
    }
    assert allocator_counters({}) == dict.fromkeys(pools.last_counters, 0)
