"""Paged decode attention in Triton (CUDA only), flash-decoding style.

One program per (sequence, KV head, split): it loads the G query heads that share the KV head
(GQA: one K/V read serves all of them, the G rows padded to 16 for the tensor cores), walks its
share of the sequence's context through the block table, and keeps an online softmax. With more
than one split, a second kernel merges the partial results by their log-sum-exp. Padded batch
slots have seq_len 0 and produce zeros. Shapes are fixed per batch bucket, so the launch is
CUDA-graph safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from gpu_runtime.engine.attention.decode_split import choose_num_splits, choose_tile
from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.kv_cache import PagedKVCache


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_bt,
    stride_ob,
    stride_oh,
    num_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM]

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        t_mask = tok < end
        block = tl.load(table + tok // BLOCK_SIZE, mask=t_mask, other=0)
        base = block.to(tl.int64) * stride_cb + kv_head * stride_ch + (tok % BLOCK_SIZE) * stride_ct
        k = tl.load(k_cache_ptr + base[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        row = (seq * num_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], result, mask=g_mask[:, None]
        )
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = (seq * num_heads + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    w = tl.where(s_mask, w, 0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    merged = tl.sum(parts * w[:, None], 0) / denom
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty)
    )


@functools.cache
def _device_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_sms: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    q `[B, H, D]`; key/value_cache `[num_blocks, Hkv, block_size, D]` (a strided view is fine,
    last dim contiguous); block_tables `[B, W]` int32; seq_lens `[B]` int32 (context length
    including the new token, whose K/V must already be written). Returns `[B, H, D]`. The
    tile left unset (`block_n`, `num_warps`, `num_stages`) is `decode_split.choose_tile`'s for
    this batch on `num_sms` SMs (default: the device's).
    `pdl`: both kernels are launched as programmatic dependents (`fused_ops`' docstring).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if key_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("last dims of q and caches must be contiguous")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must have equal strides")
    if num_sms is None:
        num_sms = _device_sms(q.device)
    tile = choose_tile(batch * num_kv_heads, num_splits, num_sms)
    block_n = tile.block_n if block_n is None else block_n
    num_warps = tile.num_warps if num_warps is None else num_warps
    num_stages = tile.num_stages if num_stages is None else num_stages
    block_n = max(16, min(block_n, 128))
    group_pad = max(16, triton.next_power_of_2(group))
    if num_splits > 1:
        part_out = torch.empty(
            batch * num_heads * num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(batch * num_heads * num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = out
        part_lse = seq_lens
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        head_dim**-0.5,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            HEAD_DIM=head_dim,
            USE_PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return out


def paged_decode_fn(
    block_size: int, rows: int, num_kv_heads: int, num_sms: int
) -> Callable[..., torch.Tensor]:
    """A `mixed.DecodeFn` running `paged_decode_attention` for `rows` single-query rows."""
    splits = choose_num_splits(rows, num_kv_heads, num_sms)

    def decode(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q, key_cache, value_cache, tables, lens, block_size, splits, num_sms=num_sms
        )

    return decode


class TritonDecodeAttention:
    """`AttentionFn` for a decode-only batch `[B]` (one token per sequence) on CUDA."""

    def __init__(self, cache: PagedKVCache, metadata: AttentionMetadata, num_splits: int) -> None:
        self.cache = cache
        self.metadata = metadata
        self.num_splits = num_splits

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [B, H, D]; k, v [B, Hkv, D]
        meta = self.metadata
        self.cache.write(layer_idx, k, v, meta.slot_blocks, meta.slot_offsets)
        return paged_decode_attention(
            q.contiguous(),
            self.cache.key_caches[layer_idx],
            self.cache.value_caches[layer_idx],
            meta.block_tables,
            meta.seq_lens,
            self.cache.block_size,
            self.num_splits,
        )
