from __future__ import annotations

import pytest

from gpu_runtime.engine.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_append_free_exact_ids_and_order() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    table_a: list[int] = []
    assert bm.append_slots(table_a, 5) == [0, 1]
    assert bm.append_slots(table_a, 8) == []
    assert bm.append_slots(table_a, 9) == [2]
    table_b = bm.allocate(2)
    assert table_b == [3, 4]
    assert bm.num_free_blocks == 1 and bm.free_block_ids() == [5]
    bm.free(table_a)
    # free ids come back lowest first, whatever order they were freed in
    assert bm.free_block_ids() == [0, 1, 2, 5]
    assert bm.allocate(3) == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks, 1 free"):
        bm.allocate(2)


def test_fork_shares_blocks_by_ref_count() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    parent = bm.allocate(2)
    child = bm.fork(parent)
    assert child == [0, 1]
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [2, 2, 0]
    bm.free(parent)
    assert [bm.ref_count(b) for b in (0, 1)] == [1, 1]
    assert bm.num_free_blocks == 2
    bm.free(child)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    with pytest.raises(ValueError, match="not allocated"):
        bm.free([0])


def test_shrink_takes_only_free_blocks_highest_first_and_grow_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, capacity=10)
    used = bm.allocate(3)  # 0, 1, 2
    assert bm.shrink(3) == [7, 6, 5]
    assert bm.num_usable_blocks == 5
    assert bm.shrink(10) == [4, 3]  # never the used ones
    assert bm.num_free_blocks == 0 and bm.num_usable_blocks == 3
    with pytest.raises(ValueError, match="not free"):
        bm.remove([used[0]])
    bm.grow([8, 9, 3])
    assert bm.free_block_ids() == [3, 8, 9]
    with pytest.raises(ValueError, match="already usable"):
        bm.grow([3])
    with pytest.raises(ValueError, match="outside storage capacity 10"):
        bm.grow([10])
    with pytest.raises(ValueError, match="duplicates"):
        bm.grow([4, 4])
    bm.remove([9])
    assert bm.free_block_ids() == [3, 8]
    assert bm.allocate(1) == [3] and bm.free_block_ids() == [8]


def test_after_a_burst_live_blocks_stay_low_so_the_top_can_be_shrunk() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    burst = [bm.allocate(2) for _ in range(4)]  # [0, 1], [2, 3], [4, 5], [6, 7]
    assert burst == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for table in (burst[1], burst[3], burst[0]):  # finish in arrival-unrelated order
        bm.free(table)
    assert bm.free_block_ids() == [0, 1, 2, 3, 6, 7, 8, 9]
    # new sequences fill the holes at the bottom, not the freed top blocks
    assert bm.allocate(3) == [0, 1, 2]
    bm.free(burst[2])
    assert bm.shrink(6) == [9, 8, 7, 6, 5, 4]
    assert bm.num_used_blocks == 3 and bm.free_block_ids() == [3]
