"""Triton expand-add of the batched multi-LoRA decode step (imported only on CUDA).

After the shrink GEMM `shrink = x @ a.T` (`[T, G*S*R]`, every slot's columns for every token),
one kernel adds each row's own slot's term into the base projection's output in place:
`out[t, cols of module g] += shrink[t, g, slot(t), :] @ b[slot(t), :, cols]`. A program owns a
block of output columns (inside one module), loads that block of `b` once for all slots and
applies the row/slot mask before a `tl.dot`; rows with slot -1 (base requests, bucket padding)
are never stored, so they stay bit-identical to the base model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_runtime.lora.groups import LoraGroup, lora_expand_add_reference


@triton.jit
def _lora_expand_add_kernel(
    out_ptr,
    shrink_ptr,
    b_ptr,
    slots_ptr,
    num_tokens,
    n_total,
    bound1,
    bound2,
    stride_out,
    stride_shrink,
    stride_b,
    SR: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_total
    group = (n0 >= bound1).to(tl.int32) + (n0 >= bound2).to(tl.int32)  # module of this block
    for t0 in range(0, num_tokens, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < num_tokens
        slot = tl.load(slots_ptr + offs_t, mask=t_mask, other=-1).to(tl.int32)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, SR, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            c_mask = offs_c < SR
            keep = (offs_c[None, :] // RANK == slot[:, None]) & t_mask[:, None] & c_mask[None, :]
            sh = tl.load(
                shrink_ptr + offs_t[:, None] * stride_shrink + group * SR + offs_c[None, :],
                mask=keep,
                other=0.0,
            )  # [BLOCK_T, BLOCK_C]: only the row's own slot's columns
            bv = tl.load(
                b_ptr + offs_c[:, None] * stride_b + offs_n[None, :],
                mask=c_mask[:, None] & n_mask[None, :],
                other=0.0,
            )  # [BLOCK_C, BLOCK_N]
            acc += tl.dot(sh, bv)
        store = (t_mask & (slot >= 0))[:, None] & n_mask[None, :]
        ptrs = out_ptr + offs_t[:, None] * stride_out + offs_n[None, :]
        base = tl.load(ptrs, mask=store, other=0.0)
        tl.store(ptrs, (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=store)


def _block_n(group: LoraGroup, n_total: int) -> int:
    """Largest column block (<= 64) inside which no module boundary falls; 0 if none >= 16."""
    block = 64 if n_total > 8192 else 32
    while block >= 16:
        if all(bound % block == 0 for bound in group.bounds):
            return block
        block //= 2
    return 0


def lora_expand_add_(
    out: torch.Tensor, shrink: torch.Tensor, group: LoraGroup, slots: torch.Tensor
) -> None:
    """In place: out `[T, out_total]` += each row's slot's LoRA term (see the module docstring).

    shrink `[T, G*S*R]` (stride 1 along columns), slots `[T]` int (-1: base row)."""
    tokens, n_total = out.shape
    block_n = _block_n(group, n_total)
    if len(group.bounds) > 2 or block_n == 0 or out.stride(1) != 1 or group.b.stride(1) != 1:
        lora_expand_add_reference(out, shrink, group, slots)  # odd shapes: exact torch form
        return
    width = group.b.shape[0]
    bounds = (*group.bounds, n_total, n_total)[:2]
    block_t = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    block_c = max(16, min(64, triton.next_power_of_2(width)))
    _lora_expand_add_kernel[(triton.cdiv(n_total, block_n),)](
        out,
        shrink,
        group.b,
        slots,
        tokens,
        n_total,
        bounds[0],
        bounds[1],
        out.stride(0),
        shrink.stride(0),
        group.b.stride(0),
        SR=width,
        RANK=group.max_rank,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        BLOCK_N=block_n,
        num_warps=4,
    )
