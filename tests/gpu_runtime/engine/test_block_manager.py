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
    # freed in reverse table order, appended behind the still-free block 5
    assert bm.free_block_ids() == [5, 2, 1, 0]
    assert bm.allocate(3) == [5, 2, 1]
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
    assert bm.free_block_ids() == [8, 9, 3]
    with pytest.raises(ValueError, match="already usable"):
        bm.grow([3])
    with pytest.raises(ValueError, match="outside storage capacity 10"):
        bm.grow([10])
    bm.remove([9])
    assert bm.free_block_ids() == [8, 3]
