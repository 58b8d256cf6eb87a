"""Split-K Triton GEMM for decode's skinny shapes: `x [M, K] @ w[N, K].T (+ bias)` with M <= 64
(imported only on CUDA).

At decode batch sizes a projection is a weight read: M rows are nothing beside N x K weights.
cuBLAS picks tiles for larger M and leaves o_proj / q|k|v at 0.63 / 0.77 of copy bandwidth
inside the decode graphs (H200, `bench/results/decode-mixed-h200-20261130.json`). Here each
program owns `BLOCK_N` output columns of every row and one K slice (`split` slices), streams
its `[BLOCK_N, BLOCK_K]` weight tiles with 16-byte loads along K (software-pipelined by
`num_stages`), and `tl.dot`s them against the `[BLOCK_M, BLOCK_K]` rows (BLOCK_M >= 16, the
padding rows masked). With `split > 1` the fp32 partials go to a `[split, M, N]` workspace and
a second kernel sums them in slice order (deterministic: same bits every run), adds the bias
and casts; with `split == 1` the first kernel does that itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 64
"""Largest M the kernel takes (larger batches go to cuBLAS)."""


class SkinnyConfig(NamedTuple):
    """Tile shape and split of one skinny GEMM launch."""

    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    K_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k0 = pid_k * (K_TILES * BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(K_TILES):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask)


@triton.jit
def _split_reduce_kernel(
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = offs < total
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    row = offs // N
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_config(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig | None:
    """Tiles and split for `[m, k] x [n, k]^T`, or None where the kernel does not apply (M >
    `MAX_ROWS`, K not a multiple of the K tile). Aims at 2-4 programs per SM with 64-column
    tiles; more rows take fewer splits (the workspace grows with M)."""
    if m > MAX_ROWS or m < 1:
        return None
    block_k = 256 if m <= 16 else 128
    if k % block_k:
        return None
    block_n = 64
    columns = triton.cdiv(n, block_n)
    split = 1
    while columns * split < 2 * num_sms and k % (2 * split * block_k) == 0 and split < 8:
        split *= 2
    return SkinnyConfig(block_n, block_k, split)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    num_sms: int = 132,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x [M, K]` (row stride free, unit column stride),
    `weight [N, K]` (contiguous rows); falls back to `F.linear` where the kernel does not apply.
    Output `[M, N]` contiguous, in `x`'s dtype."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or choose_config(m, n, k, num_sms)
    if (
        config is None
        or x.stride(1) != 1
        or weight.stride(1) != 1
        or k % (config.split * config.block_k)
    ):
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = config.split
    workspace = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    block_m = max(16, triton.next_power_of_2(m))
    has_bias = bias is not None
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(n, config.block_n), split)
    _skinny_gemm_kernel[grid](
        x,
        weight,
        bias_arg,
        out,
        workspace,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=has_bias,
        SPLIT=split,
        K_TILES=k // (split * config.block_k),
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split > 1:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            workspace,
            bias_arg,
            out,
            m,
            n,
            out.stride(0),
            HAS_BIAS=has_bias,
            SPLIT=split,
            BLOCK=block,
        )
    return out
