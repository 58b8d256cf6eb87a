"""One-pass Triton penalties for the CUDA sampler (imported only on CUDA, or under the Triton
interpreter in tests).

The torch form of vLLM's penalties (`logits_processing.apply_penalties`) gathers the penalised
rows' counts and prompt marks (`[P, V]` copies) and makes about ten passes over `[P, V]`. Here
each program reads one block of a row's logits, its request row's counts and prompt marks
straight from `TokenCounts` (no gather), applies repetition, frequency and presence penalties in
registers and writes the logits back in place: one read of the counts and marks, one read and
write of the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _penalties_kernel(
    logits_ptr,
    logits_stride,
    batch_rows_ptr,
    count_rows_ptr,
    counts_ptr,
    prompt_ptr,
    counts_stride,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    vocab,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    row = tl.load(batch_rows_ptr + i)
    count_row = tl.load(count_rows_ptr + i)
    presence = tl.load(presence_ptr + i)
    frequency = tl.load(frequency_ptr + i)
    repetition = tl.load(repetition_ptr + i)
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=0.0)
    count = tl.load(counts_ptr + count_row * counts_stride + cols, mask=mask, other=0)
    in_prompt = tl.load(prompt_ptr + count_row * counts_stride + cols, mask=mask, other=0)
    in_output = count > 0
    seen = in_output | (in_prompt != 0)
    factor = tl.where(seen, repetition, 1.0)
    x = tl.where(x > 0, x / factor, x * factor)
    x = x - frequency * count.to(tl.float32)
    x = x - tl.where(in_output, presence, 0.0)
    tl.store(logits_ptr + row * logits_stride + cols, x, mask=mask)


def apply_penalties_in_place(
    logits: torch.Tensor,
    batch_rows: torch.Tensor,
    count_rows: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    """vLLM's penalties on rows `batch_rows` `[P]` of fp32 `logits` `[B, V]` (unit column
    stride), in place; row `batch_rows[i]` reads counts row `count_rows[i]` of `output_counts`
    `[R, V]` int32 and `prompt_mask` `[R, V]` bool (both contiguous); penalties `[P]` fp32."""
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 with unit column stride, got {logits.dtype}")
    if not (output_counts.is_contiguous() and prompt_mask.is_contiguous()):
        raise ValueError("output_counts and prompt_mask must be contiguous")
    if output_counts.shape != prompt_mask.shape or output_counts.shape[1] != logits.shape[1]:
        raise ValueError(
            f"counts {tuple(output_counts.shape)} / prompt {tuple(prompt_mask.shape)} do not "
            f"match logits {tuple(logits.shape)}"
        )
    penalised, vocab = batch_rows.shape[0], logits.shape[1]
    if penalised == 0:
        return
    grid = (penalised, triton.cdiv(vocab, _BLOCK))
    _penalties_kernel[grid](
        logits,
        logits.stride(0),
        batch_rows,
        count_rows,
        output_counts,
        prompt_mask.view(torch.uint8),
        output_counts.stride(0),
        presence,
        frequency,
        repetition,
        vocab,
        BLOCK=_BLOCK,
        num_warps=4,
    )
