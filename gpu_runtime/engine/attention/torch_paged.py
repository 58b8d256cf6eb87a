"""Paged attention with plain torch ops: gather each sequence's K/V, then SDPA.

The reference backend: runs anywhere (fp32 on CPU), handles prefill chunks and decode alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.kv_cache import PagedKVCache


def torch_compute_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype the torch attention paths compute in on ``device``: fp32 on the CPU (its bf16
    math is slow and loose), None (the inputs' dtype) elsewhere."""
    return torch.float32 if device.type == "cpu" else None


class TorchPagedAttention:
    """`AttentionFn` over a `PagedKVCache`: writes this step's K/V, then attends per sequence.

    compute_dtype: dtype of the attention math (fp32 on CPU; None keeps the input dtype).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        metadata: AttentionMetadata,
        compute_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        if metadata.query_lens_host is None or metadata.seq_lens_host is None:
            raise ValueError("TorchPagedAttention needs host query_lens and seq_lens")
        self.cache = cache
        self.metadata = metadata
        self.compute_dtype = compute_dtype
        self.query_lens = metadata.query_lens_host
        self.seq_lens = metadata.seq_lens_host

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D]
        meta = self.metadata
        self.cache.write(layer_idx, k, v, meta.slot_blocks, meta.slot_offsets)
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        dtype = self.compute_dtype or q.dtype
        start = 0
        for i, (count, length) in enumerate(zip(self.query_lens, self.seq_lens, strict=True)):
            if count == 0:
                continue
            if length == 0:  # a padded slot of a fixed-shape batch: attends to nothing
                out[start : start + count] = 0
                start += count
                continue
            keys, values = self.cache.gather(layer_idx, meta.block_tables[i], length)
            qi = q[start : start + count].transpose(0, 1).to(dtype)  # [H, n, D]
            ki = keys.transpose(0, 1).repeat_interleave(groups, dim=0).to(dtype)  # [H, L, D]
            vi = values.transpose(0, 1).repeat_interleave(groups, dim=0).to(dtype)
            if count == 1:
                oi = F.scaled_dot_product_attention(qi, ki, vi)
            elif count == length:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
            else:
                rows = torch.arange(count, device=q.device)[:, None] + (length - count)
                mask = torch.arange(length, device=q.device)[None, :] <= rows  # [n, L]
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask)
            out[start : start + count] = oi.transpose(0, 1).to(q.dtype)
            start += count
        return out
