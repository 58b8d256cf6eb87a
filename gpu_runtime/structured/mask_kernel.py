"""The bitmask applied to logits rows on CUDA in one Triton launch (imported on CUDA only).

Program (i, b) masks columns `[b * BLOCK, (b + 1) * BLOCK)` of logits row `rows[i]` with row i
of the bitmask: a column whose bit is 0 becomes -inf, the others are left as they are. One read
of the masked rows' logits and bitmask words, one write; other rows are never touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr, stride, bits_ptr, words, rows_ptr, vocab, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + i)
    word = tl.load(bits_ptr + i * words + cols // 32, mask=inside, other=0)
    banned = ((word >> (cols % 32)) & 1) == 0
    pointers = logits_ptr + row * stride + cols
    x = tl.load(pointers, mask=inside & banned, other=0.0)
    tl.store(pointers, tl.full([BLOCK], float("-inf"), x.dtype), mask=inside & banned)


def apply_bitmask_cuda(logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits `[B, V]` (unit column stride) rows `rows[i]` masked by `bits[i]`.
    bits `[R, ceil(V / 32)]` int32 and rows `[R]` int64 on the logits' device."""
    if logits.stride(1) != 1:
        raise ValueError(f"logits need a unit column stride, got strides {logits.stride()}")
    count, words = bits.shape
    vocab = logits.shape[1]
    grid = (count, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](
        logits, logits.stride(0), bits, words, rows, vocab, BLOCK=_BLOCK, num_warps=4
    )
