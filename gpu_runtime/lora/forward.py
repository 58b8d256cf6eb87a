"""The serving model's forward pass with the batched multi-LoRA term, for the decode engine.

:class:`MultiLoraForward` runs the serving model's own decoder (``DecoderStack.run``) over
:class:`MultiLoraOps`: the model's modules — its fused ``q|k|v`` and ``gate|up`` GEMMs when it
has them, the injected ``attention`` object (paged or dense), ``[T]`` flattened or ``[B, S]``
tokens — exactly as ``CausalLM.forward`` runs them (``ModuleOps``), plus ``weights.delta(...)``
added after each adapted projection. Tokens without an adapter get a delta of exactly zero, so
their hidden states equal the serving model's bit for bit, in the same batch as adapter tokens.
"""

from __future__ import annotations

import torch

from gpu_runtime.lora.stacked import StackedLoraWeights
from gpu_runtime.model import CausalLM
from gpu_runtime.model.attention import AttentionFn, DenseCausalAttention
from gpu_runtime.model.module_ops import GateUpProjections, ModuleOps, QKVProjections
from gpu_runtime.model.modules import MLP, Attention, RMSNorm


class MultiLoraOps:
    """``ModuleOps`` plus each token's adapter term after every adapted projection."""

    def __init__(self, base: ModuleOps, weights: StackedLoraWeights) -> None:
        self.base = base
        self.weights = weights

    def _add(self, y: torch.Tensor, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        delta = self.weights.delta(layer, module, x)
        return y if delta is None else y + delta

    def norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.norm(norm, x, residual)

    def qkv(self, index: int, attn: Attention, h: torch.Tensor) -> QKVProjections:
        q, k, v = attn.project(h)
        return (
            self._add(q, index, "q_proj", h),
            self._add(k, index, "k_proj", h),
            self._add(v, index, "v_proj", h),
        )

    def rope_and_attend(self, index: int, attn: Attention, qkv: QKVProjections) -> torch.Tensor:
        return self.base.rope_and_attend(index, attn, qkv)

    def o(self, index: int, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        return self._add(attn.o_proj(out), index, "o_proj", out)

    def gate_up(self, index: int, mlp: MLP, h: torch.Tensor) -> GateUpProjections:
        gate, up = mlp.gate_up(h)
        return self._add(gate, index, "gate_proj", h), self._add(up, index, "up_proj", h)

    def silu_and_mul(self, index: int, gate_up: GateUpProjections) -> torch.Tensor:
        return self.base.silu_and_mul(index, gate_up)

    def down(self, index: int, mlp: MLP, act: torch.Tensor) -> torch.Tensor:
        return self._add(mlp.down_proj(act), index, "down_proj", act)


class MultiLoraForward:
    """``(input_ids, positions, attention=None) -> hidden`` like ``CausalLM.forward``, plus LoRA."""

    def __init__(self, serving: CausalLM, weights: StackedLoraWeights) -> None:
        self.serving = serving
        self.weights = weights

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
        cos, sin = model.rope_cos_sin(positions, model.model.embed_tokens.weight.dtype)
        ops = MultiLoraOps(ModuleOps(cos, sin, attention), self.weights)
        return model.model.run(ops, input_ids)
