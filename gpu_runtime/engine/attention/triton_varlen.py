"""Varlen paged attention in Triton: every query token of a step in one launch per layer.

Grid `(num_tiles, num_kv_heads)`; tile t (see `varlen.py`) is `block_q` query tokens of one
sequence times the G query heads of one KV head, `block_q * G` rows padded to a power of two
(>= 16) for the tensor cores. A program walks its sequence's keys `0 .. last query position` in
`BLOCK_N`-token tiles gathered through the block table (any KV block size), applies the causal
rule by absolute positions (so a chunk after a cached prefix needs nothing special) and keeps
an online softmax in fp32. Nothing step-specific is a compile-time constant: one compiled
kernel per (head geometry, block size, dtype) serves steps of any lengths and any mix of
decode rows and chunks; only the grid changes (the step's counts are arguments Triton does not
specialize on, so a new count never compiles a new variant).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from gpu_runtime.engine.attention.varlen import VarlenTiles, varlen_block_q

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_seqs", "num_tiles"])
def _varlen_paged_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    tiles_ptr,
    out_ptr,
    qk_scale,
    num_seqs,
    num_tiles,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # tiles_ptr: [query_start (num_seqs + 1) | tile_seq (num_tiles) | tile_q (num_tiles)]
    seq = tl.load(tiles_ptr + num_seqs + 1 + tile)
    q0 = tl.load(tiles_ptr + num_seqs + 1 + num_tiles + tile)
    begin = tl.load(tiles_ptr + seq)
    count = tl.load(tiles_ptr + seq + 1) - begin
    length = tl.load(seq_lens_ptr + seq)
    prefix = length - count

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    qi = q0 + offs_m // GROUP  # query index inside the sequence
    heads = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (qi < count)
    tokens = (begin + qi).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]
    positions = prefix + qi  # absolute position of each row's query
    kv_end = tl.minimum(length, prefix + tl.minimum(q0 + BLOCK_Q, count))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        keys_at = n0 + offs_n
        k_ok = keys_at < kv_end
        block = tl.load(table + keys_at // BLOCK_SIZE, mask=k_ok, other=0)
        base = (
            block.to(tl.int64) * stride_cb
            + kv_head * stride_ch
            + (keys_at % BLOCK_SIZE) * stride_ct
        )
        k = tl.load(k_cache_ptr + base[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        allowed = (keys_at[None, :] <= positions[:, None]) & k_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def varlen_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: torch.Tensor,
    num_tiles: int,
    block_size: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of every query token of a step over its paged context.

    q `[T, H, D]` (rows and heads strided, last dim contiguous); key/value_cache `[num_blocks,
    Hkv, block_size, D]` (equal strides, last dim contiguous); block_tables `[B, W]` int32;
    seq_lens `[B]` int32 (context after this step, K/V written); tiles: the device copy of
    `VarlenTiles.packed()` built with `varlen_block_q(H // Hkv)` (int32). Returns out
    `[T, H, D]` (tokens of sequences with no context: zeros)."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if key_cache.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("last dims of q, out and the caches must be contiguous")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must have equal strides")
    if num_tiles == 0:
        return out
    block_q = varlen_block_q(group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    _varlen_paged_kernel[(num_tiles, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        tiles,
        out,
        head_dim**-0.5 * _LOG2E,
        block_tables.shape[0],
        num_tiles,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def triton_varlen_fn(block_size: int) -> Callable[..., torch.Tensor]:
    """A `mixed.VarlenFn` running `varlen_paged_attention`."""

    def attend(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        tiles: VarlenTiles,
        tiles_device: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return varlen_paged_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            tiles_device,
            tiles.num_tiles,
            block_size,
            out,
        )

    return attend
