"""KV-cache block manager in plain integers (no torch).

Blocks are ids into the runner's KV storage. A block is used (ref count >= 1) or free (ref
count 0); a free block is empty (in the free heap) or cached (it carries a prefix-cache digest,
`prefix_cache.PrefixCache`, and its KV stays valid until it is evicted). Allocation hands out
the lowest empty ids first, so without prefix caching live blocks stay at the bottom of the id
range and a memory pool can take pages back from the top after a burst; when no empty block is
left it evicts cached free blocks, least recently freed first (their digests are dropped).
Sequences own a block table (a list of ids) that grows as they do; `fork` shares a table's
blocks by reference counting, and a prefix-cache hit (`touch`) takes one more reference on each
block found. The set of usable ids can change at run time: `grow` adds storage blocks that a
memory pool hands over, `shrink`/`remove` take free blocks out (never used ones; cached free
blocks first, their digests dropped) so the pool can reclaim their storage.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from gpu_runtime.engine.prefix_cache import BlockHash, PrefixCache


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free."""


class BlockManager:
    """Allocates, shares and frees KV blocks: the lowest empty id first, then cached free
    blocks, least recently freed first."""

    def __init__(self, num_blocks: int, block_size: int, capacity: int | None = None) -> None:
        """Blocks 0..num_blocks-1 start usable and free; ids up to `capacity`-1 may be added
        later with `grow` (capacity defaults to num_blocks)."""
        capacity = num_blocks if capacity is None else capacity
        if num_blocks < 0 or block_size < 1 or capacity < num_blocks:
            raise ValueError(
                f"num_blocks={num_blocks}, block_size={block_size}, capacity={capacity}: need "
                "num_blocks >= 0, block_size >= 1, capacity >= num_blocks"
            )
        self.block_size = block_size
        self.capacity = capacity
        self._free: list[int] = list(range(num_blocks))  # a heap (sorted is a valid heap)
        self._free_set: set[int] = set(self._free)
        self._ref_counts: dict[int, int] = {}
        self.cache = PrefixCache()
        """Digests of cached blocks and the evictable order; changed only through this class."""

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (empty plus cached free)."""
        return len(self._free) + self.cache.num_evictable_blocks

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks carrying no cached KV (allocated before any cached free block)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count >= 1."""
        return len(self._ref_counts)

    @property
    def num_usable_blocks(self) -> int:
        """Free plus used blocks."""
        return self.num_free_blocks + len(self._ref_counts)

    def ref_count(self, block_id: int) -> int:
        """References held on `block_id` (0 when free or not usable)."""
        return self._ref_counts.get(block_id, 0)

    def free_block_ids(self) -> list[int]:
        """Free ids, empty and cached, ascending."""
        return sorted([*self._free, *self.cache.evictable_ids()])

    def empty_block_ids(self) -> list[int]:
        """Empty free ids in allocation order (ascending)."""
        return sorted(self._free)

    def evictable_block_ids(self) -> list[int]:
        """Cached free ids in eviction order (least recently freed first)."""
        return list(self.cache.evictable_ids())

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks `block_table` lacks to hold `num_tokens` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        """True when `num_blocks` blocks are free."""
        return num_blocks <= self.num_free_blocks

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref count 1 each): the lowest empty ids in ascending
        order, then cached free blocks evicted least recently freed first (digests dropped)."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        free = self._free
        empty = min(num_blocks, len(free))
        out = [heapq.heappop(free) for _ in range(empty)]
        for block_id in out:
            self._free_set.discard(block_id)
        evict = self.cache.evict_oldest
        out.extend(evict() for _ in range(num_blocks - empty))
        for block_id in out:
            self._ref_counts[block_id] = 1
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each cached block of a prefix-cache hit (`cache.lookup`): a
        cached free block leaves the evictable set (ref count 1), a used one gains a reference.
        """
        cache = self.cache
        for block_id in block_ids:
            if cache.block_hash(block_id) is None:
                raise ValueError(f"block {block_id} is not cached")
        for block_id in block_ids:
            count = self._ref_counts.get(block_id, 0)
            if count == 0:
                cache.unpark(block_id)
            self._ref_counts[block_id] = count + 1

    def cache_blocks(self, block_table: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Name `block_table[i]` by `hashes[i]` for every i < len(hashes) (the table's full,
        computed blocks), skipping blocks already named and digests that already name another
        block (that block stays uncached and becomes empty when freed)."""
        insert = self.cache.insert
        ref_counts = self._ref_counts
        for block_id, block_hash in zip(block_table, hashes, strict=False):
            if block_id not in ref_counts:
                raise ValueError(f"block {block_id} is not allocated")
            insert(block_id, block_hash)

    def append_slots(self, block_table: list[int], num_tokens: int) -> list[int]:
        """Extend `block_table` in place so it holds `num_tokens` tokens; returns the new ids."""
        new = self.allocate(self.num_new_blocks(block_table, num_tokens))
        block_table.extend(new)
        return new

    def fork(self, block_table: list[int]) -> list[int]:
        """A new table sharing every block of `block_table` (each ref count + 1)."""
        for block_id in block_table:
            if block_id not in self._ref_counts:
                raise ValueError(f"block {block_id} is not allocated")
            self._ref_counts[block_id] += 1
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 become free: a cached one the
        newest evictable block, the others empty. The table is walked from its end, so a
        sequence's later blocks are evicted before its earlier ones (a prefix outlives its
        continuations)."""
        ref_counts = self._ref_counts
        for block_id in block_table:
            if block_id not in ref_counts:
                raise ValueError(f"block {block_id} is not allocated")
        cache = self.cache
        for block_id in reversed(block_table):
            count = ref_counts[block_id]
            if count == 1:
                del ref_counts[block_id]
                if cache.block_hash(block_id) is not None:
                    cache.park(block_id)
                else:
                    heapq.heappush(self._free, block_id)
                    self._free_set.add(block_id)
            else:
                ref_counts[block_id] = count - 1

    # ---- resizing (memory pool hand-over) ---------------------------------------------------
    def grow(self, block_ids: list[int]) -> None:
        """Make storage blocks `block_ids` usable (free)."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids {block_ids[:8]} contain duplicates")
        for block_id in block_ids:
            if not 0 <= block_id < self.capacity:
                raise ValueError(f"block {block_id} outside storage capacity {self.capacity}")
            if (
                block_id in self._free_set
                or block_id in self._ref_counts
                or self.cache.is_evictable(block_id)
            ):
                raise ValueError(f"block {block_id} is already usable")
        for block_id in block_ids:
            heapq.heappush(self._free, block_id)
            self._free_set.add(block_id)

    def shrink(self, num_blocks: int) -> list[int]:
        """Remove up to `num_blocks` free blocks: cached free blocks first, least recently
        freed first (their digests dropped), then empty ones, highest ids first; returns the
        removed ids in that order.

        Used blocks are never taken, so fewer may come back than asked for.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        victims = list(self.cache.evictable_ids())[:num_blocks]
        victims += heapq.nlargest(num_blocks - len(victims), self._free_set)
        self.remove(victims)
        return victims

    def remove(self, block_ids: list[int]) -> None:
        """Remove specific free blocks (empty or cached; a cached one's digest is dropped) from
        the usable set; raises, changing nothing, if any is used or unknown."""
        cache = self.cache
        bad = [b for b in block_ids if b not in self._free_set and not cache.is_evictable(b)]
        if bad:
            raise ValueError(f"blocks {bad[:8]} are not free (used or not usable)")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids {block_ids[:8]} contain duplicates")
        empty = {b for b in block_ids if b in self._free_set}
        for block_id in block_ids:
            if block_id not in empty:
                cache.drop(block_id)
        if empty:
            self._free = [b for b in self._free if b not in empty]
            heapq.heapify(self._free)
            self._free_set -= empty
