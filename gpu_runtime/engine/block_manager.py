"""KV-cache block manager in plain integers (no torch).

Blocks are ids into the runner's KV storage. A block is free (ref count 0, in the free heap) or
used (ref count >= 1). Allocation always hands out the lowest free ids, so live blocks stay at
the bottom of the id range and a memory pool can take pages back from the top after a burst.
Sequences own a block table (a list of ids) that grows as they do; `fork` shares a table's
blocks by reference counting. The set of usable ids can change at run time: `grow` adds storage
blocks that a memory pool hands over, `shrink`/`remove` take free blocks out (never used ones)
so the pool can reclaim their storage.
"""

from __future__ import annotations

import heapq


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free."""


class BlockManager:
    """Allocates, shares and frees KV blocks; the lowest free id is allocated first."""

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

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count >= 1."""
        return len(self._ref_counts)

    @property
    def num_usable_blocks(self) -> int:
        """Free plus used blocks."""
        return len(self._free) + len(self._ref_counts)

    def ref_count(self, block_id: int) -> int:
        """References held on `block_id` (0 when free or not usable)."""
        return self._ref_counts.get(block_id, 0)

    def free_block_ids(self) -> list[int]:
        """Free ids in allocation order (ascending)."""
        return sorted(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks `block_table` lacks to hold `num_tokens` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        """True when `num_blocks` blocks are free."""
        return num_blocks <= len(self._free)

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take the `num_blocks` lowest free ids (ref count 1 each), in ascending order."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        free = self._free
        out = [heapq.heappop(free) for _ in range(num_blocks)]
        for block_id in out:
            self._free_set.discard(block_id)
            self._ref_counts[block_id] = 1
        return out

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
        """Drop one reference on each block; blocks reaching 0 become free."""
        for block_id in block_table:
            count = self._ref_counts.get(block_id)
            if count is None:
                raise ValueError(f"block {block_id} is not allocated")
            if count == 1:
                del self._ref_counts[block_id]
                heapq.heappush(self._free, block_id)
                self._free_set.add(block_id)
            else:
                self._ref_counts[block_id] = count - 1

    # ---- resizing (memory pool hand-over) ---------------------------------------------------
    def grow(self, block_ids: list[int]) -> None:
        """Make storage blocks `block_ids` usable (free)."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids {block_ids[:8]} contain duplicates")
        for block_id in block_ids:
            if not 0 <= block_id < self.capacity:
                raise ValueError(f"block {block_id} outside storage capacity {self.capacity}")
            if block_id in self._free_set or block_id in self._ref_counts:
                raise ValueError(f"block {block_id} is already usable")
        for block_id in block_ids:
            heapq.heappush(self._free, block_id)
            self._free_set.add(block_id)

    def shrink(self, num_blocks: int) -> list[int]:
        """Remove up to `num_blocks` free blocks, highest ids first; returns the removed ids.

        Used blocks are never taken, so fewer may come back than asked for.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        victims = heapq.nlargest(num_blocks, self._free_set)
        self.remove(victims)
        return victims

    def remove(self, block_ids: list[int]) -> None:
        """Remove specific free blocks from the usable set; raises if any is used or unknown."""
        wanted = set(block_ids)
        bad = [b for b in block_ids if b not in self._free_set]
        if bad:
            raise ValueError(f"blocks {bad[:8]} are not free (used or not usable)")
        self._free = [b for b in self._free if b not in wanted]
        heapq.heapify(self._free)
        self._free_set -= wanted
