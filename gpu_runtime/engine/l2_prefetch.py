"""Bulk L2 prefetch kernels of the CUDA decode step (Hopper; imported only on CUDA).

Each thread issues one `cp.async.bulk.prefetch.L2` for a range of up to `chunk_bytes`: the
instruction only queues the range, so the kernel ends within a few microseconds and the bytes
load into L2 while the kernels after it run. What is prefetched and when: `prefetch_plan`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_runtime.engine.prefetch_plan import (
    L2Prefetch,
    check_range,
    kv_blocks_per_row,
    range_chunks,
)

LANES = 32
"""Threads (one warp) per program, one bulk prefetch each."""


@triton.jit
def _bulk_prefetch(ptrs, sizes, EVICT_LAST: tl.constexpr):
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptrs, sizes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            "=r,l,r",
            [ptrs, sizes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _prefetch_range_kernel(
    base_ptr,
    num_elems,
    ELEM_BYTES: tl.constexpr,
    CHUNK_ELEMS: tl.constexpr,
    LANES: tl.constexpr,
    EVICT_LAST: tl.constexpr,
):
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    offs = lane.to(tl.int64) * CHUNK_ELEMS
    active = offs < num_elems
    elems = tl.minimum(num_elems - offs, CHUNK_ELEMS)
    # an idle lane asks for the range's first 16 bytes again (no predicate needed)
    sizes = tl.where(active, elems * ELEM_BYTES, 16).to(tl.int32)
    ptrs = base_ptr + tl.where(active, offs, 0)
    _bulk_prefetch(ptrs, sizes, EVICT_LAST)


@triton.jit
def _prefetch_kv_kernel(
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    stride_block,
    stride_table,
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    LANES: tl.constexpr,
    EVICT_LAST: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.program_id(1) * LANES + tl.arange(0, LANES)
    seq_len = tl.load(seq_lens_ptr + row)
    used = tl.minimum((seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE, max_blocks)
    active = j < used
    block = tl.load(block_tables_ptr + row * stride_table + j, mask=active, other=0)
    first = tl.load(block_tables_ptr + row * stride_table)
    block = tl.where(active, block, first)
    ptrs = cache_ptr + block.to(tl.int64) * stride_block
    sizes = tl.where(active, BLOCK_BYTES, 16).to(tl.int32)
    _bulk_prefetch(ptrs, sizes, EVICT_LAST)


def prefetch_tensor(tensor: torch.Tensor, settings: L2Prefetch) -> None:
    """Ask L2 for a contiguous tensor's bytes (a weight)."""
    if not tensor.is_contiguous():
        raise ValueError("L2 prefetch of a tensor needs it contiguous")
    elem = tensor.element_size()
    nbytes = tensor.numel() * elem
    check_range(tensor.data_ptr(), nbytes)
    chunks = range_chunks(nbytes, settings.chunk_bytes)
    if chunks == 0:
        return
    _prefetch_range_kernel[(triton.cdiv(chunks, LANES),)](
        tensor,
        tensor.numel(),
        ELEM_BYTES=elem,
        CHUNK_ELEMS=settings.chunk_bytes // elem,
        LANES=LANES,
        EVICT_LAST=settings.evict_last,
        num_warps=1,
    )


def prefetch_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    settings: L2Prefetch,
) -> None:
    """Ask L2 for the first blocks of each row's K and V of one layer (at most
    `settings.kv_max_bytes` over the batch). Caches `[num_blocks, Hkv, block_size, D]` views of
    the block-major storage: a block's K and V of one layer lie side by side, one range."""
    rows = block_tables.shape[0]
    elem = key_cache.element_size()
    half = key_cache[0].numel() * elem
    side_by_side = value_cache.data_ptr() - key_cache.data_ptr() == half
    if not side_by_side or key_cache.stride() != value_cache.stride():
        raise ValueError("L2 prefetch of K/V needs each block's K and V of a layer side by side")
    check_range(key_cache.data_ptr(), 2 * half)
    check_range(key_cache.stride(0) * elem, 0)
    per_row = min(block_tables.shape[1], kv_blocks_per_row(rows, 2 * half, settings.kv_max_bytes))
    if per_row == 0 or rows == 0:
        return
    _prefetch_kv_kernel[(rows, triton.cdiv(per_row, LANES))](
        key_cache,
        block_tables,
        seq_lens,
        key_cache.stride(0),
        block_tables.stride(0),
        per_row,
        BLOCK_SIZE=block_size,
        BLOCK_BYTES=2 * half,
        LANES=LANES,
        EVICT_LAST=settings.evict_last,
        num_warps=1,
    )
