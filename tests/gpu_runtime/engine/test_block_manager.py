from __future__ import annotations

import hashlib
from array import array

import pytest

from gpu_runtime.engine.block_manager import BlockManager, NoFreeBlocksError
from gpu_runtime.engine.prefix_cache import extend_block_hashes, hash_block_tokens


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


# ---- prefix caching (digests, hits, eviction order) -----------------------------------------
def _hashes(tokens: list[int], block_size: int = 4, extra: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, len(tokens), block_size, extra)
    return out


def _cached_table(bm: BlockManager, tokens: list[int], extra: str | None = None) -> list[int]:
    """A computed sequence of `tokens`: its blocks allocated and its full ones cached."""
    table: list[int] = []
    bm.append_slots(table, len(tokens))
    bm.cache_blocks(table, _hashes(tokens, bm.block_size, extra))
    return table


def test_block_hash_chains_parent_tokens_and_extra_key() -> None:
    tokens = list(range(1, 13))
    first, second, third = _hashes(tokens)
    # no parent (32 zero bytes), no extra key (length 0, flag 0), then the int64 token ids
    header = b"\0" * 32 + (0).to_bytes(4, "little") + b"\0"
    assert first == hashlib.sha256(header + array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert second == hash_block_tokens(first, [5, 6, 7, 8], None)
    assert third == hash_block_tokens(second, [9, 10, 11, 12], None)
    # the same tokens after another prefix, or under an adapter, are another block
    assert hash_block_tokens(None, [5, 6, 7, 8], None) != second
    assert _hashes(tokens, extra="x")[0] != first
    assert hash_block_tokens(None, [1, 2, 3, 4], "") != first
    assert _hashes(tokens[:7]) == [first]  # only full blocks have digests


def test_full_and_partial_hits_take_references() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _cached_table(bm, list(range(1, 11)))  # 10 tokens: blocks 0, 1 full, 2 partial
    assert a == [0, 1, 2]
    assert [bm.cache.block_hash(b) is not None for b in a] == [True, True, False]
    assert bm.cache.lookup(_hashes(list(range(1, 13)))) == [0, 1]  # full hit of both blocks
    partial = bm.cache.lookup(_hashes([1, 2, 3, 4, 5, 6, 7, 99]))
    assert partial == [0]
    bm.touch(partial)
    assert [bm.ref_count(b) for b in a] == [2, 1, 1]
    bm.free(a)
    # a's blocks: 0 still held by the hit, 1 cached and evictable, 2 (partial) empty
    assert [bm.ref_count(b) for b in a] == [1, 0, 0]
    assert bm.evictable_block_ids() == [1] and bm.empty_block_ids() == [2, 3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 7 and bm.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    bm.touch(bm.cache.lookup(_hashes(list(range(1, 9)))))  # re-hit of freed block 1
    assert bm.ref_count(1) == 1 and bm.evictable_block_ids() == []
    with pytest.raises(ValueError, match="block 2 is not cached"):
        bm.touch([2])


def test_no_hit_under_another_adapter_or_the_base_model() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(1, 10))
    bm.free(_cached_table(bm, tokens, extra="x"))
    assert bm.cache.lookup(_hashes(tokens, extra="x")) == [0, 1]
    assert bm.cache.lookup(_hashes(tokens, extra="y")) == []
    assert bm.cache.lookup(_hashes(tokens)) == []


def test_empty_blocks_go_first_then_evictions_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _cached_table(bm, list(range(1, 9)))  # [0, 1], both cached
    b = _cached_table(bm, list(range(21, 33)))  # [2, 3, 4], all cached
    c = bm.allocate(1)  # [5], never cached
    bm.free(b)
    bm.free(c)
    bm.free(a)
    # each table is freed from its end: its prefix outlives its continuation
    assert bm.evictable_block_ids() == [4, 3, 2, 1, 0]
    assert bm.empty_block_ids() == [5, 6, 7]
    assert bm.allocate(4) == [5, 6, 7, 4]  # empty ids lowest first, then the oldest freed
    assert bm.cache.block_hash(4) is None and bm.cache.num_cached_blocks == 4
    assert bm.cache.lookup(_hashes(list(range(21, 33)))) == [2, 3]
    assert bm.allocate(2) == [3, 2]
    assert bm.evictable_block_ids() == [1, 0] and bm.num_free_blocks == 2
    with pytest.raises(NoFreeBlocksError, match="asked for 3 blocks, 2 free"):
        bm.allocate(3)


def test_a_re_hit_block_freed_again_is_the_newest_evictable() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _cached_table(bm, list(range(1, 9)))  # [0, 1]
    b = _cached_table(bm, list(range(11, 15)))  # [2]
    bm.free(a)
    bm.free(b)
    assert bm.evictable_block_ids() == [1, 0, 2]
    hit = bm.cache.lookup(_hashes(list(range(1, 5))))
    assert hit == [0]
    bm.touch(hit)
    assert bm.evictable_block_ids() == [1, 2]
    bm.free(hit)
    assert bm.evictable_block_ids() == [1, 2, 0]


def test_forked_and_shared_cached_blocks_count_references() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    parent = _cached_table(bm, [1, 2, 3, 4])  # [0, 1]
    child = bm.fork(parent)
    bm.touch(bm.cache.lookup(_hashes([1, 2, 3, 4], block_size=2)))  # a third sharer
    assert [bm.ref_count(b) for b in (0, 1)] == [3, 3]
    bm.free(parent)
    bm.free(child)
    assert [bm.ref_count(b) for b in (0, 1)] == [1, 1] and bm.evictable_block_ids() == []
    bm.free([0, 1])
    assert bm.evictable_block_ids() == [1, 0] and bm.num_used_blocks == 0


def test_a_digest_names_one_block_a_duplicate_stays_uncached() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(1, 5))
    first = _cached_table(bm, tokens)
    second = _cached_table(bm, tokens)  # computed twice (both missed in one step)
    assert first == [0] and second == [1]
    assert bm.cache.block_hash(1) is None and bm.cache.lookup(_hashes(tokens)) == [0]
    bm.free(second)
    assert bm.empty_block_ids() == [1, 2, 3] and bm.evictable_block_ids() == []


def test_shrink_takes_cached_free_blocks_first_and_drops_their_digests() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _cached_table(bm, list(range(1, 9)))  # [0, 1]
    b = _cached_table(bm, list(range(11, 15)))  # [2]
    held = bm.allocate(1)  # [3]
    bm.free(a)
    bm.free(b)
    assert bm.evictable_block_ids() == [1, 0, 2]
    assert bm.shrink(4) == [1, 0, 2, 7]  # cached free (oldest first), then empty (highest)
    assert bm.cache.num_cached_blocks == 0 and bm.cache.lookup(_hashes(list(range(1, 9)))) == []
    assert bm.free_block_ids() == [4, 5, 6] and bm.ref_count(held[0]) == 1
    assert bm.shrink(8) == [6, 5, 4]  # never the used block
    bm.grow([0, 1, 2])  # storage handed back comes back empty
    assert bm.empty_block_ids() == [0, 1, 2] and bm.evictable_block_ids() == []


def test_remove_takes_cached_free_blocks_and_refuses_used_ones() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _cached_table(bm, list(range(1, 9)))  # [0, 1]
    bm.touch([0])
    bm.free(a)  # 0 still held by the hit, 1 evictable
    with pytest.raises(ValueError, match=r"blocks \[0\] are not free"):
        bm.remove([1, 0])
    assert bm.evictable_block_ids() == [1]  # nothing changed
    with pytest.raises(ValueError, match="already usable"):
        bm.grow([1])
    bm.remove([3, 1])
    assert bm.free_block_ids() == [2] and bm.cache.num_cached_blocks == 1
    assert bm.cache.lookup(_hashes(list(range(1, 9)))) == [0]


def test_block_hashes_extend_from_a_window_of_the_sequence() -> None:
    tokens = list(range(1, 30))
    whole = _hashes(tokens)
    assert len(whole) == 7
    hashes = whole[:3]
    extend_block_hashes(hashes, tokens[12:28], 28, 4, None, offset=12)
    assert hashes == whole
    with pytest.raises(ValueError, match="offset 16 is past block 3's first token"):
        extend_block_hashes(whole[:3], tokens[16:], 28, 4, None, offset=16)
