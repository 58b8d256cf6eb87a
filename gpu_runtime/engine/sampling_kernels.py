"""One-pass Triton sampling for the CUDA decode step (imported only on CUDA).

Rows without top-k/top-p and without logprobs need only `argmax(logits / T + Gumbel noise)`
(the Gumbel-max form of the sampler's exponential race: `-log E` with `E = -log U` is Gumbel).
The logits are read once, the noise is drawn in registers (Philox, `tl.rand(seed, vocab
index)`) and a running argmax is kept, instead of a float copy, a divide, a noise tensor, its
log, a subtraction and an argmax over `[B, V]` in fp32 (about six passes over 16 MB at batch 32,
128 MB at batch 256). A row with inverse temperature 0 is greedy (plain argmax; ties pick the
first index, like `torch.argmax`). A row's noise depends only on its seed and the vocabulary
index, so seeded requests do not depend on the batch they run in, nor on how the row is split.

Work split: each row's vocabulary is cut into `parts` contiguous ranges, one program each
(grid `rows x parts`), so a small batch still fills the GPU (one program per row left all but
one SM idle at batch 1 and streamed 128k logits through a single SM); a second kernel reduces
each row's partial maxima, keeping the smallest index among equal maxima. Tokens do not depend
on `parts`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_TARGET_PROGRAMS = 512
"""Partial programs aimed for per call (about four per SM on an H200's 132)."""
_MAX_PARTS = 128
_LANES = 128
"""Lanes of the reduce kernel (>= _MAX_PARTS): one compiled variant for every part count, so a
batch size seen for the first time mid-run does not wait for a compile (the part count is not
specialised either: it changes with the batch size)."""


@triton.jit(do_not_specialize=["parts"])
def _gumbel_argmax_partial_kernel(
    logits_ptr,
    inv_temp_ptr,
    seeds_ptr,
    part_val_ptr,
    part_idx_ptr,
    vocab,
    stride,
    part_len,
    parts,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    seed = tl.load(seeds_ptr + row)
    offs = tl.arange(0, BLOCK)
    first = part * part_len
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, part_len, BLOCK):
        cols = first + start + offs
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
    # among lanes holding the maximum, the smallest column (first occurrence); a part with
    # only -inf keeps its first column so a row of -inf still returns index 0 like argmax
    candidate = tl.where(best_val == top, best_idx, 2147483647)
    index = tl.where(top == float("-inf"), first, tl.min(candidate, 0))
    tl.store(part_val_ptr + row * parts + part, top)
    tl.store(part_idx_ptr + row * parts + part, index)


@triton.jit(do_not_specialize=["parts"])
def _argmax_of_parts_kernel(part_val_ptr, part_idx_ptr, out_ptr, parts, LANES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, LANES)
    present = offs < parts
    vals = tl.load(part_val_ptr + row * parts + offs, mask=present, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * parts + offs, mask=present, other=2147483647)
    top = tl.max(vals, 0)
    # parts are in column order and each holds its smallest maximal column: the smallest
    # index among the parts reaching the maximum is the row's first maximum
    candidate = tl.where(vals == top, idx, 2147483647)
    tl.store(out_ptr + row, tl.min(candidate, 0).to(tl.int64))


def num_parts(rows: int, vocab: int) -> int:
    """Vocabulary ranges per row: about `_TARGET_PROGRAMS` programs in all, at most one per
    `_BLOCK` columns and at most `_MAX_PARTS`."""
    wanted = -(-_TARGET_PROGRAMS // max(rows, 1))
    return max(1, min(wanted, _MAX_PARTS, -(-vocab // _BLOCK)))


def gumbel_argmax(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    parts: int | None = None,
) -> torch.Tensor:
    """Sampled token per row `[B]` int64. logits `[B, V]` (row stride arbitrary, unit column
    stride), inv_temperature `[B]` fp32 (0: greedy), seeds `[B]` int64 (Philox seed per row).
    `parts`: vocabulary ranges per row (None: `num_parts`)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    parts = parts or num_parts(rows, vocab)
    per_part = -(-vocab // parts)  # ceil(V / parts), rounded up to a BLOCK multiple
    part_len = -(-per_part // _BLOCK) * _BLOCK
    dev = logits.device
    part_val = torch.empty(rows, parts, dtype=torch.float32, device=dev)
    part_idx = torch.empty(rows, parts, dtype=torch.int32, device=dev)
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    _gumbel_argmax_partial_kernel[(rows, parts)](
        logits,
        inv_temperature,
        seeds,
        part_val,
        part_idx,
        vocab,
        logits.stride(0),
        part_len,
        parts,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    _argmax_of_parts_kernel[(rows,)](
        part_val,
        part_idx,
        out,
        parts,
        LANES=_LANES,
        num_warps=1,
    )
    return out
