"""The CUDA decode step over a `CausalLM`'s own weights, with fused Triton kernels.

Same math as `CausalLM.forward` + `compute_logits` for one token per sequence (checked against
it in the GPU tests), in about ten kernels per layer instead of about thirty-five: the step is
short enough that launches, not bytes, would otherwise dominate at small batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.triton_decode import paged_decode_attention
from gpu_runtime.engine.fused_ops import rms_norm, rope_and_cache_write, silu_and_mul
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.engine.lora import LoraGroup, apply_lora_group_
from gpu_runtime.model.llama import CausalLM


class FusedDecodeForward:
    """Callable `(input_ids [B], positions [B], metadata, num_splits) -> logits [B, V]`.

    The model must have had `fuse_projections()` applied (the runner does it).
    """

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        max_positions: int,
        lora_groups: Sequence[Mapping[str, LoraGroup]] | None = None,
    ) -> None:
        """`lora_groups` (per layer, `LoraRuntime.decode_groups()`): the stacked adapter slots
        added when a call passes `lora_slots`."""
        self.model = model
        self.lora_groups = lora_groups
        self.cache = cache
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        dtype = model.model.embed_tokens.weight.dtype
        device = model.model.embed_tokens.weight.device
        positions = torch.arange(max_positions, device=device)
        cos, sin = model.rope_cos_sin(positions, dtype)  # [P, 1, D]
        half = self.head_dim // 2
        self.cos = cos[:, 0, :half].contiguous()
        self.sin = sin[:, 0, :half].contiguous()
        for layer in model.decoder_layers:
            if layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None:
                raise ValueError("FusedDecodeForward needs model.fuse_projections() first")

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        num_splits: int,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`lora_slots` `[B]` (-1: base row): add each row's adapter slot's LoRA terms (one
        shrink GEMM + one expand kernel per adapted projection group), in place after the base
        GEMMs. Without it the step has no LoRA kernels at all."""
        model = self.model
        groups = self.lora_groups if lora_slots is not None else None
        batch = input_ids.shape[0]
        x = model.model.embed_tokens(input_ids)  # [B, hidden]
        residual: torch.Tensor | None = None
        for index, layer in enumerate(model.decoder_layers):
            attn, mlp = layer.self_attn, layer.mlp
            h, residual = rms_norm(x, layer.input_layernorm.weight, self.eps, residual)
            qkv = F.linear(h, attn.qkv_weight, attn.qkv_bias)  # type: ignore[arg-type]
            lora = groups[index] if groups is not None else None
            if lora is not None and "qkv" in lora:
                apply_lora_group_(qkv, h, lora["qkv"], lora_slots)  # type: ignore[arg-type]
            key_cache = self.cache.key_caches[index]
            value_cache = self.cache.value_caches[index]
            q = rope_and_cache_write(
                qkv,
                positions,
                self.cos,
                self.sin,
                key_cache,
                value_cache,
                metadata.slot_blocks,
                metadata.slot_offsets,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )  # [B, H, D]
            out = paged_decode_attention(
                q,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                self.cache.block_size,
                num_splits,
            )
            attn_in = out.view(batch, -1)
            x = F.linear(attn_in, attn.o_proj.weight, attn.o_proj.bias)
            if lora is not None and "o" in lora:
                apply_lora_group_(x, attn_in, lora["o"], lora_slots)  # type: ignore[arg-type]
            h, residual = rms_norm(x, layer.post_attention_layernorm.weight, self.eps, residual)
            gate_up = F.linear(h, mlp.gate_up_weight)  # type: ignore[arg-type]
            if lora is not None and "gate_up" in lora:
                apply_lora_group_(gate_up, h, lora["gate_up"], lora_slots)  # type: ignore[arg-type]
            act = silu_and_mul(gate_up)
            x = F.linear(act, mlp.down_proj.weight)
            if lora is not None and "down" in lora:
                apply_lora_group_(x, act, lora["down"], lora_slots)  # type: ignore[arg-type]
        h, _ = rms_norm(x, model.model.norm.weight, self.eps, residual)
        return model.compute_logits(h)
