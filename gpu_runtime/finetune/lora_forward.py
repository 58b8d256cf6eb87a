"""The serving model's forward pass with the batched multi-LoRA term, for the decode engine.

:class:`MultiLoraForward` runs exactly the serving model's own computation — its modules, its
fused ``q|k|v`` and ``gate|up`` GEMMs when it has them, the injected ``attention`` object (paged
or dense), ``[T]`` flattened or ``[B, S]`` tokens — and adds ``weights.delta(...)`` after each
adapted projection. Tokens without an adapter get a delta of exactly zero, so their hidden states
equal the serving model's bit for bit, in the same batch as adapter tokens. It mirrors
``CausalLM.forward`` line by line; a test holds the two equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gpu_runtime.finetune.multi_lora import StackedLoraWeights
from gpu_runtime.model import CausalLM
from gpu_runtime.model.llama import AttentionFn, DenseCausalAttention, apply_rope


class MultiLoraForward:
    """``(input_ids, positions, attention=None) -> hidden`` like ``CausalLM.forward``, plus LoRA."""

    def __init__(self, serving: CausalLM, weights: StackedLoraWeights) -> None:
        self.serving = serving
        self.weights = weights

    def _add(self, y: torch.Tensor, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        delta = self.weights.delta(layer, module, x)
        return y if delta is None else y + delta

    def _attention(
        self,
        index: int,
        attn: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        q_flat, k_flat, v_flat = attn.project(x)
        q_flat = self._add(q_flat, index, "q_proj", x)
        k_flat = self._add(k_flat, index, "k_proj", x)
        v_flat = self._add(v_flat, index, "v_proj", x)
        q = q_flat.reshape(*lead, attn.num_heads, attn.head_dim)
        k = k_flat.reshape(*lead, attn.num_kv_heads, attn.head_dim)
        v = v_flat.reshape(*lead, attn.num_kv_heads, attn.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = attention(index, q, k, v).reshape(*lead, attn.num_heads * attn.head_dim)
        return self._add(attn.o_proj(out), index, "o_proj", out)

    def _mlp(self, index: int, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.gate_up(x)
        gate = self._add(gate, index, "gate_proj", x)
        up = self._add(up, index, "up_proj", x)
        hidden = F.silu(gate) * up
        return self._add(mlp.down_proj(hidden), index, "down_proj", hidden)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm; call ``weights.set_token_slots`` first with one
        slot per token of ``input_ids`` (flattened order)."""
        model = self.serving
        if input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ"
            )
        if input_ids.numel() != self.weights.num_tokens:
            raise ValueError(
                f"{input_ids.numel()} tokens but set_token_slots gave {self.weights.num_tokens}"
            )
        if attention is None:
            if input_ids.dim() != 2:
                raise ValueError("attention=None needs [B, S] input_ids")
            attention = DenseCausalAttention()
        x = model.model.embed_tokens(input_ids)
        cos, sin = model.rope_cos_sin(positions, x.dtype)
        layer: Any
        for index, layer in enumerate(model.model.layers):
            x = x + self._attention(
                index, layer.self_attn, layer.input_layernorm(x), cos, sin, attention
            )
            x = x + self._mlp(index, layer.mlp, layer.post_attention_layernorm(x))
        return model.model.norm(x)
