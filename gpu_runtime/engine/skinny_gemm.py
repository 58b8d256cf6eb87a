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

`prefetch_linear` is the same product for a decode step launched with programmatic dependent
launch (`fused_ops`' docstring): each program owns one `[BLOCK_N, BLOCK_K]` weight tile, loads
all of it before `gdc_wait` (weights are never written by a kernel), and only then loads its
rows of x, so a projection's weight reads may run while the latency-bound kernels before it
(norm, attention, SwiGLU; launched with `early_trigger`) still run. Partials go to a
`[split, M, N]` fp32 workspace summed in slice order by the reduce kernel (deterministic).
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
def _prefetch_gemm_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.dot(x, tl.trans(w))  # [BLOCK_M, BLOCK_N] fp32
    ws = ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(ws, acc, mask=m_mask[:, None] & n_mask[None, :])


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
    USE_PDL: tl.constexpr = False,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = offs < total
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
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


class PrefetchConfig(NamedTuple):
    """Tile of one `prefetch_linear` launch: each program holds a `[block_n, block_k]` weight
    tile; `split` = K / block_k slices (rounded up)."""

    block_n: int
    block_k: int
    split: int
    num_warps: int


PREFETCH_MAX_ROWS = 16
"""Largest M `prefetch_linear` takes (larger go to `F.linear`): its x tile is padded to 16 rows,
and a 32-row tile pushes the kernel past 200 registers a thread."""


def choose_prefetch_config(m: int, n: int, k: int) -> PrefetchConfig | None:
    """Tile for `prefetch_linear` of `[m, k] x [n, k]^T`, or None past `PREFETCH_MAX_ROWS`.

    32 x 512 bf16 weight tiles (32 KB) and 4 warps: compiled by Triton 3.6 for sm_90 the
    program takes 150 registers a thread, so 3 fit an SM, 96 KB of weight reads in flight
    each (12.7 MB on 132 SMs). Wider or taller tiles do not hold more: 64 x 512 on 8 warps
    takes 160 registers (1 a SM), 32 x 1024 on 8 warps 210 (1 a SM); 32 x 256 takes 80 (6 a
    SM, the same 96 KB) but doubles the slices, whose fp32 partials are written and read back
    (`ws`: split x M x N x 4 bytes)."""
    if not 1 <= m <= PREFETCH_MAX_ROWS or n < 1 or k < 1:
        return None
    block_k = min(512, max(16, triton.next_power_of_2(k)))
    return PrefetchConfig(32, block_k, triton.cdiv(k, block_k), 4)


def prefetch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool = False,
    config: PrefetchConfig | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x [M, K]` (row stride free, unit column stride),
    `weight [N, K]` (contiguous rows), each program's weight tile loaded before it waits for
    the kernel before it (`pdl`: both kernels launched as programmatic dependents; module
    docstring). Falls back to `F.linear` past `PREFETCH_MAX_ROWS` rows. Output `[M, N]`
    contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or choose_prefetch_config(m, n, k)
    if config is None or x.stride(1) != 1 or weight.stride(1) != 1:
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    workspace = torch.empty(config.split, m, n, dtype=torch.float32, device=x.device)
    _prefetch_gemm_kernel[(triton.cdiv(n, config.block_n), config.split)](
        x,
        weight,
        workspace,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=1,
        launch_pdl=pdl,
    )
    block = 1024
    _split_reduce_kernel[(triton.cdiv(m * n, block),)](
        workspace,
        bias if bias is not None else out,
        out,
        m,
        n,
        out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT=config.split,
        BLOCK=block,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return out
