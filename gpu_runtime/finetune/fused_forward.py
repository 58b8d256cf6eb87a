"""The trainer's fast forward pass: same math as the peft-wrapped tree, fewer and larger kernels.

The peft layers stay in the tree (their ``lora_A``/``lora_B`` parameters are what trains, is
saved and loads into ``PeftModel``); only the forward computation is arranged differently:

* base projections use the serving model's fused ``q|k|v`` and ``gate|up`` weights when it has
  them (the decode engine fuses them), so each is one GEMM;
* the adapters of projections that share an input share one ``lora_A`` GEMM (the A matrices
  concatenated) and add their ``scaling * lora_B`` term through one ``addmm`` whose epilogue does
  the add: no per-module scale and add passes, no fp32 copy of the activations;
* LoRA dropout draws **one mask per shared input** (q/k/v share one, gate/up another), where peft
  draws one per module — the same distribution per module, correlated across modules. A layer's
  masks (bool, one byte per element) are drawn before the layer runs and passed in, and the
  ``1 / (1 - p)`` rescale rides on the ``scaling * B`` matrix. Under tensor parallelism the
  masks are one GPU's (a row-parallel input's drawn whole, each rank keeping its columns), so
  training with dropout equals one GPU's too;
* RMSNorm uses ``torch.nn.functional.rms_norm`` (fused on CUDA), attention SDPA with
  ``enable_gqa`` (no repeated K/V).

The layer walk is the model's own (``DecoderStack.layer_output``); :class:`FusedTrainingOps`,
one per layer and forward (it holds that layer's masks), supplies these kernels. With dropout 0
the result equals the peft path up to float rounding (a test holds it there).

**Recomputation** (``activation_checkpointing=True``): each decoder layer runs under
``torch.utils.checkpoint`` (non-reentrant), which keeps only the layer's input and recomputes
its activations in the backward. The layer draws no randomness itself (its dropout masks are
inputs, drawn once in the forward in the same order either way), so the checkpoint does not
stash or restore any RNG state (``preserve_rng_state=False``): the recomputed forward sees the
same masks by construction, gradients equal those without recomputation, and the whole thing
can be captured in a CUDA graph (reading or setting a CUDA generator's state is forbidden
during a capture). What stays alive per layer is its input ``[B, S, H]`` plus, with dropout,
its masks (``3 H + I`` bytes per token on a Llama layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.finetune.lora import ADAPTER_NAME
from gpu_runtime.finetune.loss import embed, run_layer_range
from gpu_runtime.model import CausalLM
from gpu_runtime.model.module_ops import GateUpProjections, QKVProjections
from gpu_runtime.model.modules import MLP, Attention, RMSNorm
from gpu_runtime.model.rope import apply_rope

Masks = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
"""One layer's LoRA dropout masks, for the inputs of ``(qkv, o, gate_up, down)``."""


@dataclass
class _Projection:
    """One projection in the training tree: base weight/bias and its LoRA (if targeted)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_a: nn.Parameter | None
    lora_b: nn.Parameter | None
    scaling: float
    dropout: float


def _projection(module: Any) -> _Projection:
    if hasattr(module, "base_layer"):  # peft lora.Linear
        base = module.base_layer
        return _Projection(
            weight=base.weight,
            bias=base.bias,
            lora_a=module.lora_A[ADAPTER_NAME].weight,
            lora_b=module.lora_B[ADAPTER_NAME].weight,
            scaling=float(module.scaling[ADAPTER_NAME]),
            dropout=float(getattr(module.lora_dropout[ADAPTER_NAME], "p", 0.0)),
        )
    assert isinstance(module, nn.Linear)
    return _Projection(module.weight, module.bias, None, None, 0.0, 0.0)


@dataclass
class _Group:
    """Projections reading the same input, computed as one base GEMM plus one LoRA update."""

    projections: list[_Projection]
    fused_weight: torch.Tensor | None  # rows of all projections, when the serving model fused them
    fused_bias: torch.Tensor | None

    @property
    def dropout(self) -> float:
        """The LoRA dropout of this group's input (0 when no projection is adapted)."""
        adapted = [p for p in self.projections if p.lora_a is not None]
        return adapted[0].dropout if adapted else 0.0

    @property
    def in_features(self) -> int:
        return int(self.projections[0].weight.shape[1])

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, adapters: bool = True
    ) -> torch.Tensor:
        """``[..., in] -> [..., sum(out)]``, the outputs concatenated in group order; ``mask``
        (bool, shaped like ``x``): the LoRA input's dropout mask (None: no dropout);
        ``adapters=False``: the base projections alone."""
        if self.fused_weight is not None:
            out = F.linear(x, self.fused_weight, self.fused_bias)
        else:
            outs = [F.linear(x, p.weight, p.bias) for p in self.projections]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        adapted = [p for p in self.projections if p.lora_a is not None]
        if not adapted or not adapters:
            return out
        # dropout: the kept inputs, rescaled by 1 / (1 - p) through B below
        x_in = x if mask is None else x * mask
        keep_scale = 1.0 if mask is None else 1.0 / (1.0 - self.dropout)
        a_list: list[torch.Tensor] = [p.lora_a for p in adapted if p.lora_a is not None]
        a_cat = torch.cat(a_list) if len(a_list) > 1 else a_list[0]
        shrink = F.linear(x_in, a_cat)  # [..., sum(r)]
        # [sum(out), sum(r)]: each adapter's scaling * B in its own row and column block
        widths = [p.weight.shape[0] for p in self.projections]
        ranks = [p.lora_a.shape[0] for p in adapted if p.lora_a is not None]
        b_full = a_cat.new_zeros(sum(widths), sum(ranks))  # adapter (master) dtype
        row = col = 0
        for p, width in zip(self.projections, widths, strict=True):
            if p.lora_b is not None:
                rank = p.lora_b.shape[1]
                b_full[row : row + width, col : col + rank] = p.lora_b * (p.scaling * keep_scale)
                col += rank
            row += width
        flat = torch.addmm(
            out.reshape(-1, out.shape[-1]),
            shrink.reshape(-1, shrink.shape[-1]),
            b_full.T.to(out.dtype),
        )
        return flat.reshape(out.shape)


LayerGroups = tuple[_Group, _Group, _Group, _Group]
"""One layer's projection groups: ``(qkv, o, gate_up, down)``."""
_ROW_PARALLEL_GROUPS = (1, 3)
"""The groups of ``LayerGroups`` whose input is split over tensor-parallel ranks (o, down)."""


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


class FusedTrainingOps:
    """``DecoderOps`` of one layer of one forward: its groups, its dropout masks, RoPE cos/sin
    ``[B, S, 1, D]``; ``adapters=False``: the base projections alone."""

    def __init__(
        self,
        config: ModelConfig,
        groups: LayerGroups,
        masks: Masks,
        cos: torch.Tensor,
        sin: torch.Tensor,
        adapters: bool,
    ) -> None:
        self.eps = config.rms_norm_eps
        self.groups = groups
        self.masks = masks
        self.cos = cos
        self.sin = sin
        self.adapters = adapters

    def norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else residual + x
        return _rms_norm(stream, norm.weight, self.eps), stream

    def qkv(self, index: int, attn: Attention, h: torch.Tensor) -> QKVProjections:
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, k, v = (
            self.groups[0]
            .forward(h, self.masks[0], self.adapters)
            .split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        )
        return q, k, v

    def rope_and_attend(self, index: int, attn: Attention, qkv: QKVProjections) -> torch.Tensor:
        q, k, v = qkv
        batch, seq = q.shape[:2]
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q = apply_rope(q.reshape(batch, seq, heads, dim), self.cos, self.sin).transpose(1, 2)
        k = apply_rope(k.reshape(batch, seq, kv_heads, dim), self.cos, self.sin).transpose(1, 2)
        v = v.reshape(batch, seq, kv_heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch, seq, heads * dim)

    def o(self, index: int, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        return self.groups[1].forward(out, self.masks[1], self.adapters)

    def gate_up(self, index: int, mlp: MLP, h: torch.Tensor) -> GateUpProjections:
        gate, up = self.groups[2].forward(h, self.masks[2], self.adapters).chunk(2, dim=-1)
        return gate, up

    def silu_and_mul(self, index: int, gate_up: GateUpProjections) -> torch.Tensor:
        gate, up = gate_up
        return F.silu(gate) * up

    def down(self, index: int, mlp: MLP, act: torch.Tensor) -> torch.Tensor:
        return self.groups[3].forward(act, self.masks[3], self.adapters)


class FusedTrainingForward:
    """Callable ``(input_ids [B, S], positions [B, S]) -> hidden [B, S, H]`` over a LoRA tree."""

    def __init__(self, tree: CausalLM, serving: CausalLM) -> None:
        self.tree = tree
        self.config = tree.config
        self.adapters_enabled = True
        """False: every projection computes the base model alone (DPO's reference pass)."""
        self.layers: list[LayerGroups] = []
        layer: Any
        served: Any
        for layer, served in zip(tree.model.layers, serving.model.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _Group(
                [_projection(attn.q_proj), _projection(attn.k_proj), _projection(attn.v_proj)],
                served.self_attn.qkv_weight,
                served.self_attn.qkv_bias,
            )
            gate_up = _Group(
                [_projection(mlp.gate_proj), _projection(mlp.up_proj)],
                served.mlp.gate_up_weight,
                None,
            )
            o = _Group([_projection(attn.o_proj)], None, None)
            down = _Group([_projection(mlp.down_proj)], None, None)
            self.layers.append((qkv, o, gate_up, down))

    def dropout_masks(self, index: int, lead: tuple[int, ...], device: torch.device) -> Masks:
        """Layer ``index``'s dropout masks for inputs of leading shape ``lead`` (``[B, S]``),
        one per group in ``(qkv, o, gate_up, down)`` order, drawn from the current default
        generators (the trainer swaps its own in); None for a group without dropout, and all
        None outside train mode. On a tensor-parallel rank the row-parallel inputs' (o, down)
        masks are drawn whole and cut to the rank's columns, so every rank draws what one GPU
        draws, in the same order, and keeps its part (the masks equal one GPU's)."""
        masks: list[torch.Tensor | None] = []
        size, rank = self.tree.parallel.size, self.tree.parallel.rank
        for g, group in enumerate(self.layers[index]):
            p = group.dropout
            if not self.tree.training or p <= 0:
                masks.append(None)
                continue
            width = group.in_features
            split = size > 1 and g in _ROW_PARALLEL_GROUPS
            whole = width * size if split else width
            mask = torch.empty((*lead, whole), dtype=torch.bool, device=device).bernoulli_(1.0 - p)
            masks.append(mask[..., rank * width : (rank + 1) * width] if split else mask)
        return masks[0], masks[1], masks[2], masks[3]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token embeddings ``[B, S, H]`` and RoPE cos/sin for ``positions``."""
        return embed(self.tree, input_ids, positions)

    def run_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layers: range,
        activation_checkpointing: bool,
    ) -> torch.Tensor:
        """Decoder layers ``layers`` over ``x`` ``[B, S, H]``; with ``activation_checkpointing``
        (and grad enabled) each layer's activations are recomputed in the backward (see the
        module docstring: the masks are drawn here, before the layer, so no RNG state is
        stashed)."""

        def layer_ops(index: int, x: torch.Tensor) -> FusedTrainingOps:
            masks = self.dropout_masks(index, tuple(x.shape[:-1]), x.device)
            groups = self.layers[index]
            return FusedTrainingOps(self.config, groups, masks, cos, sin, self.adapters_enabled)

        return run_layer_range(
            self.tree.model, layer_ops, x, layers, activation_checkpointing, False
        )

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.tree.model.norm.weight, self.config.rms_norm_eps)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        activation_checkpointing: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[B, S, H]``."""
        x, cos, sin = self.embed(input_ids, positions)
        x = self.run_layers(x, cos, sin, range(self.num_layers), activation_checkpointing)
        return self.final_norm(x)
