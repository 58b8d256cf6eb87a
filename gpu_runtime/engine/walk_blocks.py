"""`WalkBlocks`: the block manager's free blocks as a budget walk's decisions leave them, with
nothing changed, including which cached free blocks those decisions would evict.

The walk (`budget_walk.walk_step`) asks it in the order `ContinuousBatchingScheduler.schedule`
applies the decisions: running requests' allocations and preemptions, then admissions (a cache
hit's `claim`, then the new blocks' `take`). `BlockManager.allocate` takes empty blocks first,
then evicts cached free ones least recently freed first, and `touch` takes a hit's blocks out
of that order; `take` and `claim` follow the same rules, so a hit the walk keeps is one the
applied step still finds cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_runtime.engine.block_manager import BlockManager


class WalkBlocks:
    """Free-block counts and evictions of a walk over `block_manager` (read, never changed;
    the manager must not change while the walk runs).

    Invariant: `free` == empty blocks left + cached free blocks neither evicted nor claimed.
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.free = block_manager.num_free_blocks
        """Blocks free after the decisions so far."""
        self._empty = block_manager.num_empty_blocks
        self._lru = block_manager.cache.evictable_ids()
        self._evicted: set[int] = set()
        self._claimed: set[int] = set()
        self._released: dict[int, int] = {}

    def take(self, num_blocks: int) -> None:
        """Allocate `num_blocks` (<= `free`): empty blocks first, then evictions in order."""
        self.free -= num_blocks
        from_empty = min(num_blocks, self._empty)
        self._empty -= from_empty
        rest = num_blocks - from_empty
        claimed, evicted = self._claimed, self._evicted
        while rest > 0:
            block_id = next(self._lru)
            if block_id not in claimed:
                evicted.add(block_id)
                rest -= 1

    def release(self, block_table: Sequence[int]) -> None:
        """A preemption frees `block_table`: blocks whose last reference it drops become free.
        They are counted as empty (which of them the step's later allocations reuse matters
        to no hit: a step that preempts admits nothing)."""
        ref_count, released = self.block_manager.ref_count, self._released
        for block_id in block_table:
            drops = released.get(block_id, 0) + 1
            released[block_id] = drops
            if ref_count(block_id) == drops:
                self.free += 1
                self._empty += 1

    def usable_hits(self, hits: Sequence[int]) -> tuple[list[int], int]:
        """Of the cached blocks `hits` (a prefix found by `cache.lookup`), the prefix the walk
        has not evicted, and how many of those are free and unclaimed (the hit takes them out
        of `free`)."""
        kept: list[int] = []
        evicted, claimed = self._evicted, self._claimed
        is_evictable = self.block_manager.cache.is_evictable
        from_free = 0
        for block_id in hits:
            if block_id in evicted:
                break
            kept.append(block_id)
            if is_evictable(block_id) and block_id not in claimed:
                from_free += 1
        return kept, from_free

    def claim(self, hits: Sequence[int]) -> None:
        """Admit a hit (`usable_hits`' blocks): its free blocks leave the evictable order."""
        is_evictable = self.block_manager.cache.is_evictable
        claimed = self._claimed
        for block_id in hits:
            if is_evictable(block_id) and block_id not in claimed:
                claimed.add(block_id)
                self.free -= 1
