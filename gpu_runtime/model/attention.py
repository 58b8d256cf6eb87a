"""The attention step a decoder layer delegates to, and its dense causal form.

The module-calling decoder ops (`gpu_runtime.model.module_ops.ModuleOps`) take an `AttentionFn`
per forward: `DenseCausalAttention` for `[B, S]` batches (training, reference), or the decode
engine's paged attention, which also reads and writes its KV cache.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionFn(Protocol):
    """One attention step for one layer.

    q: `[..., n_heads, head_dim]`, k/v: `[..., n_kv_heads, head_dim]` (RoPE applied), with the
    same leading dims as the layer input (`[B, S]` dense or `[T]` flattened tokens). Returns
    `[..., n_heads, head_dim]`.
    """

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class DenseCausalAttention:
    """Causal SDPA over dense `[B, S]` batches.

    key_padding_mask: optional `[B, S]` bool, True for real tokens. Padding queries attend to
    themselves only (so no row is fully masked); their outputs are meaningless and must be
    ignored by the caller.
    """

    def __init__(self, key_padding_mask: torch.Tensor | None = None) -> None:
        self.key_padding_mask = key_padding_mask

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if q.dim() != 4:
            raise ValueError(f"dense attention needs [B, S, H, D] inputs, got q {tuple(q.shape)}")
        groups = q.shape[2] // k.shape[2]
        qt = q.transpose(1, 2)  # [B, H, S, D]
        kt = k.transpose(1, 2).repeat_interleave(groups, dim=1)
        vt = v.transpose(1, 2).repeat_interleave(groups, dim=1)
        if self.key_padding_mask is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        else:
            seq = q.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
            mask = causal[None] & self.key_padding_mask[:, None, :].to(torch.bool)
            mask = mask | torch.eye(seq, dtype=torch.bool, device=q.device)[None]
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None])
        return out.transpose(1, 2)
