"""One-pass Triton sampling for the CUDA decode step (imported only on CUDA).

Rows without top-k/top-p and without logprobs need only `argmax(logits / T + Gumbel noise)`
(the Gumbel-max form of the sampler's exponential race: `-log E` with `E = -log U` is Gumbel).
One program per row streams the row's logits once, draws its noise in registers (Philox,
`tl.rand(seed, vocab index)`), and keeps a running argmax, instead of a float copy, a divide, a
noise tensor, its log, a subtraction and an argmax over `[B, V]` in fp32 (about six passes over
16 MB at batch 32, 128 MB at batch 256). A row with inverse temperature 0 is greedy (plain
argmax; ties pick the first index, like `torch.argmax`). A row's noise depends only on its seed,
so seeded requests do not depend on the batch they run in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    inv_temp_ptr,
    seeds_ptr,
    out_ptr,
    vocab,
    stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    inv_temp = tl.load(inv_temp_ptr + row)
    seed = tl.load(seeds_ptr + row)
    offs = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf"))
        score = x.to(tl.float32)
        if inv_temp > 0:
            u = tl.rand(seed, cols)
            score = score * inv_temp - tl.log(-tl.log(u))
        score = tl.where(mask, score, float("-inf"))
        better = score > best_val  # strict: the earliest block keeps ties
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, 0)
    # among lanes holding the maximum, the smallest column (first occurrence)
    candidate = tl.where(best_val == top, best_idx, 2147483647)
    tl.store(out_ptr + row, tl.min(candidate, 0).to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Sampled token per row `[B]` int64. logits `[B, V]` (row stride arbitrary, unit column
    stride), inv_temperature `[B]` fp32 (0: greedy), seeds `[B]` int64 (Philox seed per row)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows,)](
        logits, inv_temperature, seeds, out, vocab, logits.stride(0), BLOCK=2048, num_warps=8
    )
    return out
