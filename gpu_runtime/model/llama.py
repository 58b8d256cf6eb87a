"""Llama-family causal LM (Llama 3, Qwen2/2.5) with HF parameter names.

`CausalLM.forward(input_ids, positions, attention)` returns the final-normed hidden states;
`compute_logits` applies the LM head. The decoder itself (`DecoderStack.run`) is written once in
`gpu_runtime.model.decoder`; `forward` runs it over `ModuleOps`, with the attention injected per
call: `None` means dense causal SDPA over `[B, S]` (training and reference path); the decode
engine passes a paged-attention object that reads and writes its KV cache. The fast paths run
the same `DecoderStack.run` over their own ops. Nothing in this module holds per-step state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.distributed.shard import ShardShape
from gpu_runtime.model.attention import AttentionFn, DenseCausalAttention
from gpu_runtime.model.decoder import DecoderStack
from gpu_runtime.model.module_ops import ModuleOps
from gpu_runtime.model.modules import DecoderLayer
from gpu_runtime.model.rope import rope_inv_freq


class CausalLM(nn.Module):
    """Llama-family causal LM whose `state_dict` keys equal HF's.

    Under tensor parallelism (`parallel.size > 1`) it is one rank's shard: `config` stays the
    whole model's, `shard` says which slice of each tensor this rank holds and
    `local_config` has the shapes of its modules (local heads, KV heads, MLP width, vocabulary
    rows); the hidden states and `compute_logits` are whole on every rank.

    `rope_inv_freq` is a non-persistent buffer; after building on the meta device, call
    `reset_rope(device)` once the module has real storage.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.shard = ShardShape.of(config, parallel.size, parallel.rank)
        local = self.local_config = self.shard.local_config()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.model = DecoderStack(local, parallel, self.shard.vocab_start, **factory)
        self.lm_head = nn.Linear(local.hidden_size, local.vocab_size, bias=False, **factory)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv = rope_inv_freq(config, "cpu")
        self.register_buffer("rope_inv_freq", inv.to(device) if device else inv, persistent=False)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed."""
        return cast(list[DecoderLayer], list(self.model.layers))

    def reset_rope(self, device: torch.device | str) -> None:
        """Recompute the RoPE buffer on `device` (needed after `to_empty`)."""
        self.rope_inv_freq = rope_inv_freq(self.config, device)

    def rope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[..., 1, head_dim]` for integer positions `[...]` (fp32 math, cast)."""
        freqs = positions.float()[..., None] * self.rope_inv_freq  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, shape `input_ids.shape + [hidden]`.

        input_ids/positions: `[B, S]` (dense) or `[T]` (flattened, with a paged `attention`).
        """
        if input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ"
            )
        if attention is None:
            if input_ids.dim() != 2:
                raise ValueError("attention=None needs [B, S] input_ids")
            attention = DenseCausalAttention()
        cos, sin = self.rope_cos_sin(positions, self.model.embed_tokens.weight.dtype)
        return self.model.run(ModuleOps(cos, sin, attention), input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """LM head: `[..., hidden] -> [..., vocab]` (the full vocabulary on every rank)."""
        if self.parallel.size == 1:
            return self.lm_head(hidden_states)
        local = self.lm_head(self.parallel.copy_in(hidden_states))
        return self.parallel.gather_last(local)[..., : self.config.vocab_size].contiguous()

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Serve q/k/v and gate/up from one GEMM each, for decode speed.

        Re-homes each layer's q/k/v (and gate/up) weights into one contiguous tensor and makes
        the `nn.Linear` parameters row views of it, so parameter names, values and sharing
        (same storage for the finetune tree) are unchanged. Call after the model is on its
        final device and dtype: moving it afterwards breaks the views.
        """
        for layer in self.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_weight is None:
                projections = (attn.q_proj, attn.k_proj, attn.v_proj)
                fused = torch.cat([p.weight for p in projections], dim=0)
                offset = 0
                for p in projections:
                    rows = p.weight.shape[0]
                    p.weight = nn.Parameter(fused[offset : offset + rows], requires_grad=False)
                    offset += rows
                attn.qkv_weight = fused
                if attn.q_proj.bias is not None:
                    fused_b = torch.cat([cast(torch.Tensor, p.bias) for p in projections], dim=0)
                    offset = 0
                    for p in projections:
                        rows = p.weight.shape[0]
                        p.bias = nn.Parameter(fused_b[offset : offset + rows], requires_grad=False)
                        offset += rows
                    attn.qkv_bias = fused_b
            if mlp.gate_up_weight is None:
                fused = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
                rows = mlp.gate_proj.weight.shape[0]
                mlp.gate_proj.weight = nn.Parameter(fused[:rows], requires_grad=False)
                mlp.up_proj.weight = nn.Parameter(fused[rows:], requires_grad=False)
                mlp.gate_up_weight = fused

    @torch.no_grad()
    def reserve_projection_rows(
        self, extra_rows: Mapping[str, int]
    ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """Re-home projection groups into tensors with `extra_rows[group]` zero rows after the
        base rows, so one GEMM computes the base output and `x @ extra.T` (e.g. the LoRA shrink
        of every adapter slot) together.

        Groups: "qkv" (q|k|v), "o", "gate_up" (gate|up), "down". Fuses projections first. The
        `nn.Linear` parameters (and `qkv_weight`, `qkv_bias`, `gate_up_weight`) become row views
        of the new tensors, values unchanged, so the base GEMMs read the same rows as before.
        Returns, per layer, `{group: (weight [base + extra, in], bias [base + extra] or None)}`.
        Call before building finetune trees over this model (they must see the new tensors).
        """
        self.fuse_projections()
        unknown = sorted(set(extra_rows) - {"qkv", "o", "gate_up", "down"})
        if unknown:
            raise ValueError(f"unknown projection groups {unknown}")
        result: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = []
        for layer in self.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            groups = {
                "qkv": (attn.q_proj, attn.k_proj, attn.v_proj),
                "o": (attn.o_proj,),
                "gate_up": (mlp.gate_proj, mlp.up_proj),
                "down": (mlp.down_proj,),
            }
            extended: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
            for group, extra in extra_rows.items():
                weight, bias = _rehome_rows(groups[group], extra)
                base = weight.shape[0] - extra
                if group == "qkv":
                    attn.qkv_weight = weight[:base]
                    attn.qkv_bias = None if bias is None else bias[:base]
                elif group == "gate_up":
                    mlp.gate_up_weight = weight[:base]
                extended[group] = (weight, bias)
            result.append(extended)
        return result


def _rehome_rows(
    projections: tuple[nn.Linear, ...], extra: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One tensor holding the projections' weights (then biases) as rows, plus `extra` zero
    rows; the parameters become views of it."""
    first = projections[0].weight
    rows = sum(p.weight.shape[0] for p in projections)
    weight = torch.zeros(rows + extra, first.shape[1], dtype=first.dtype, device=first.device)
    has_bias = projections[0].bias is not None
    bias = torch.zeros(rows + extra, dtype=first.dtype, device=first.device) if has_bias else None
    offset = 0
    for p in projections:
        n = p.weight.shape[0]
        weight[offset : offset + n].copy_(p.weight)
        p.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            bias[offset : offset + n].copy_(cast(torch.Tensor, p.bias))
            p.bias = nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return weight, bias
