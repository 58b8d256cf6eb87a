"""`DecoderOps` that call the layer's own modules, with an injected attention step.

The reference computation: `CausalLM.forward` (dense `[B, S]` or flattened `[T]` tokens with
the engine's paged attention) and the peft-wrapped training tree (its `nn.Linear`s are peft
LoRA layers, so the adapters apply inside the module calls). Other ops build on it (the
multi-LoRA serving ops add their terms to these projections).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.model.attention import AttentionFn
from gpu_runtime.model.modules import MLP, Attention, RMSNorm
from gpu_runtime.model.rope import apply_rope

QKVProjections = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Flat q, k, v `[..., heads * head_dim]`, before RoPE."""

GateUpProjections = tuple[torch.Tensor, torch.Tensor]
"""Gate and up `[..., intermediate]`."""


class ModuleOps:
    """`DecoderOps[QKVProjections, GateUpProjections]` over the modules.

    cos/sin: `[..., 1, head_dim]` of the tokens' positions (`CausalLM.rope_cos_sin`);
    attention: one layer's attention over the rotated q, k, v.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn) -> None:
        self.cos = cos
        self.sin = sin
        self.attention = attention

    def norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else residual + x
        return norm(stream), stream

    def qkv(self, index: int, attn: Attention, h: torch.Tensor) -> QKVProjections:
        return attn.project(h)

    def rope_and_attend(self, index: int, attn: Attention, qkv: QKVProjections) -> torch.Tensor:
        q_flat, k_flat, v_flat = qkv
        lead = q_flat.shape[:-1]
        q = q_flat.reshape(*lead, attn.num_heads, attn.head_dim)
        k = k_flat.reshape(*lead, attn.num_kv_heads, attn.head_dim)
        v = v_flat.reshape(*lead, attn.num_kv_heads, attn.head_dim)
        q = apply_rope(q, self.cos, self.sin)
        k = apply_rope(k, self.cos, self.sin)
        out = self.attention(index, q, k, v)
        return out.reshape(*lead, attn.num_heads * attn.head_dim)

    def o(self, index: int, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = attn.o_proj(out)
        return result

    def gate_up(self, index: int, mlp: MLP, h: torch.Tensor) -> GateUpProjections:
        return mlp.gate_up(h)

    def silu_and_mul(self, index: int, gate_up: GateUpProjections) -> torch.Tensor:
        gate, up = gate_up
        return F.silu(gate) * up

    def down(self, index: int, mlp: MLP, act: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = mlp.down_proj(act)
        return result
