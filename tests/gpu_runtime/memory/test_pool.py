"""Exact tests of the page geometry, the CPU backend and the pool ledger."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.memory import (
    CUDA_PAGE_BYTES,
    CpuPageBackend,
    FinetuneBudgetExceeded,
    KVLayout,
    MemoryPoolError,
    PagePool,
    create_page_pool,
    kv_block_bytes,
)

PAGE = 4096


def test_a_llama3_8b_block_of_16_tokens_is_one_cuda_page() -> None:
    block = kv_block_bytes(
        block_tokens=16, num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2
    )
    assert block == CUDA_PAGE_BYTES == 2 << 20


def test_blocks_that_straddle_pages_count_only_when_whole() -> None:
    # Qwen2.5-7B: 28 layers, 4 KV heads of 128 -> 896 KiB per 16-token block.
    block = kv_block_bytes(
        block_tokens=16, num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2
    )
    layout = KVLayout(page_bytes=CUDA_PAGE_BYTES, block_bytes=block)
    assert block == 917504
    assert [layout.blocks_in_pages(p) for p in range(5)] == [0, 2, 4, 6, 9]
    assert [layout.pages_for_blocks(b) for b in (0, 1, 2, 3, 9, 10)] == [0, 1, 1, 2, 4, 5]
    assert layout.pages_for_bytes(CUDA_PAGE_BYTES + 1) == 2
    with pytest.raises(ValueError, match="blocks must be >= 0"):
        layout.pages_for_blocks(-1)
    with pytest.raises(ValueError, match="num_layers must be positive"):
        kv_block_bytes(block_tokens=16, num_layers=0, num_kv_heads=4, head_dim=128, dtype_bytes=2)


def test_cpu_backend_maps_whole_units_and_tracks_physical_pages() -> None:
    backend = CpuPageBackend(num_pages=8, page_bytes=PAGE, map_unit_pages=2)
    assert backend.map_range(0, 4) == 4
    assert backend.mapped_slots() == frozenset(range(4))
    owners = backend.physical_owners()
    assert sorted(owners.values()) == ["free"] * 4 + ["kv:0", "kv:1", "kv:2", "kv:3"]
    with pytest.raises(MemoryPoolError, match="not aligned to 2 pages"):
        backend.map_range(4, 1)
    with pytest.raises(MemoryPoolError, match="already mapped"):
        backend.map_range(2, 2)
    with pytest.raises(MemoryPoolError, match="outside"):
        backend.map_range(8, 2)
    backend.unmap_range(2, 2)
    with pytest.raises(MemoryPoolError, match="not mapped"):
        backend.unmap_range(2, 2)
    assert backend.mapped_slots() == frozenset({0, 1})


def test_cpu_backend_map_stops_where_physical_memory_ends() -> None:
    backend = CpuPageBackend(num_pages=8, page_bytes=PAGE)
    backend.set_finetune_cap(5 * PAGE)
    backend.record_finetune_usage(peak_bytes=5 * PAGE, resident_bytes=PAGE)
    backend.set_finetune_cap(PAGE)  # cap lowered, cache not flushed yet: 5 pages still held
    assert backend.map_range(0, 6) == 3
    assert backend.mapped_slots() == frozenset({0, 1, 2})
    assert backend.release_finetune_cache() == PAGE
    assert backend.map_range(3, 4) == 4


def test_cpu_backend_enforces_the_finetune_cap_and_reports_bad_usage() -> None:
    backend = CpuPageBackend(num_pages=8, page_bytes=PAGE)
    backend.set_finetune_cap(2 * PAGE)
    with pytest.raises(FinetuneBudgetExceeded, match="exceeds its cap"):
        backend.record_finetune_usage(peak_bytes=2 * PAGE + 1, resident_bytes=0)
    with pytest.raises(MemoryPoolError, match="resident_bytes <= peak_bytes"):
        backend.record_finetune_usage(peak_bytes=PAGE, resident_bytes=2 * PAGE)
    backend.record_finetune_usage(peak_bytes=2 * PAGE, resident_bytes=100)
    assert backend.finetune_reserved_bytes() == 2 * PAGE
    assert backend.finetune_allocated_bytes() == 100
    assert backend.release_finetune_cache() == PAGE


def test_cpu_storage_is_poisoned_when_a_page_is_unmapped() -> None:
    backend = CpuPageBackend(num_pages=4, page_bytes=PAGE, materialize_kv=True)
    backend.map_range(0, 2)
    storage = backend.kv_storage()
    storage[: 2 * PAGE] = 7
    backend.unmap_range(1, 1)
    assert bool((storage[:PAGE] == 7).all())
    assert torch.isnan(storage[PAGE : 2 * PAGE].view(torch.float32)).all()
    assert torch.isnan(storage[PAGE : 2 * PAGE].view(torch.bfloat16)).all()


def test_pool_ledger_moves_pages_between_owners() -> None:
    pool = PagePool(
        CpuPageBackend(num_pages=16, page_bytes=PAGE, map_unit_pages=2), pinned_tail_pages=1
    )
    assert pool.pinned_tail_pages == 2 and pool.prefix_limit_pages == 14
    assert (pool.decode_pages, pool.finetune_pages, pool.free_pages) == (2, 0, 14)
    assert pool.grow_decode(4) == 4
    pool.lend_to_finetune(6)
    assert (pool.kv_prefix_pages, pool.decode_pages, pool.finetune_pages, pool.free_pages) == (
        4,
        6,
        6,
        4,
    )
    assert pool.finetune_budget_bytes == 6 * PAGE
    pool.check()
    pool.backend.record_finetune_usage(peak_bytes=6 * PAGE, resident_bytes=2 * PAGE + 1)
    assert pool.finetune_resident_pages() == 3
    assert pool.finetune_reclaimable_pages() == 3
    with pytest.raises(MemoryPoolError, match="held by live finetune tensors"):
        pool.reclaim_from_finetune(4)
    flushes: list[int] = []
    pool.before_flush = lambda: flushes.append(pool.backend.finetune_reserved_bytes())
    assert pool.reclaim_from_finetune(3)  # the allocator held 6 pages: over 3, flushed
    assert pool.backend.finetune_reserved_bytes() == 3 * PAGE
    assert flushes == [6 * PAGE]  # the hook ran before the flush
    pool.lend_to_finetune(2)
    assert not pool.reclaim_from_finetune(1)  # holds 3 of a 4-page budget: nothing to flush
    assert len(flushes) == 1
    assert pool.backend.finetune_reserved_bytes() == 3 * PAGE and pool.finetune_pages == 4
    pool.reclaim_from_finetune(1)
    pool.shrink_decode(2)
    pool.check()
    split = pool.split()
    assert split.decode_bytes == 4 * PAGE and split.finetune_budget_bytes == 3 * PAGE
    assert split.free_bytes == 9 * PAGE and split.pool_bytes == 16 * PAGE


def test_pool_rejects_moves_that_break_the_accounting() -> None:
    pool = PagePool(
        CpuPageBackend(num_pages=8, page_bytes=PAGE, map_unit_pages=2), pinned_tail_pages=2
    )
    with pytest.raises(MemoryPoolError, match="not a multiple of the map unit"):
        pool.grow_decode(3)
    with pytest.raises(MemoryPoolError, match="6 are free"):
        pool.lend_to_finetune(7)
    pool.lend_to_finetune(2)
    with pytest.raises(MemoryPoolError, match="4 are free"):
        pool.grow_decode(6)
    with pytest.raises(MemoryPoolError, match="0 are mapped"):
        pool.shrink_decode(2)
    with pytest.raises(MemoryPoolError, match="leaves nothing"):
        PagePool(CpuPageBackend(num_pages=4, page_bytes=PAGE), pinned_tail_pages=4)


def test_create_page_pool_on_cpu_checks_its_arguments() -> None:
    pool = create_page_pool(
        device="cpu", pool_bytes=10 * PAGE + 5, page_bytes=PAGE, map_unit_pages=4
    )
    assert pool.num_pages == 8 and pool.map_unit_pages == 4
    assert pool.kv_storage().numel() == 8 * PAGE
    with pytest.raises(ValueError, match="needs pool_bytes"):
        create_page_pool(device="cpu")
    with pytest.raises(ValueError, match="device must be"):
        create_page_pool(device="tpu", pool_bytes=PAGE)


def test_a_reclaim_without_a_flush_takes_only_the_budget_the_allocator_does_not_hold() -> None:
    pool = PagePool(CpuPageBackend(num_pages=16, page_bytes=PAGE))
    pool.lend_to_finetune(10)
    pool.backend.record_finetune_usage(peak_bytes=6 * PAGE + 1, resident_bytes=2 * PAGE)
    assert pool.finetune_held_pages() == 7 and pool.finetune_flush_free_pages() == 3
    assert pool.finetune_reclaimable_pages() == 8
    with pytest.raises(MemoryPoolError, match="without a cache flush"):
        pool.reclaim_from_finetune(4, allow_flush=False)
    assert not pool.reclaim_from_finetune(3, allow_flush=False)  # a cap change
    assert pool.finetune_flush_free_pages() == 0 and pool.last_flush_s is None
    assert pool.reclaim_from_finetune(1)  # below what the cache holds: flushed
    assert pool.last_flush_s is not None and min(pool.last_flush_s) >= 0
    assert pool.finetune_held_pages() == 2 and pool.finetune_flush_free_pages() == 4
    pool.check()
