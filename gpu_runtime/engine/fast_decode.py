"""The CUDA decode step over a `CausalLM`'s own weights, with fused Triton kernels.

Same math as `CausalLM.forward` + `compute_logits` for one token per sequence (checked against
it in the GPU tests), in about ten kernels per layer instead of about thirty-five: the step is
short enough that launches, not bytes, would otherwise dominate at small batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.mixed import MixedPagedAttention
from gpu_runtime.engine.attention.triton_decode import paged_decode_attention
from gpu_runtime.engine.fused_ops import LoraRows, rms_norm, rope_and_cache_write, silu_and_mul
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.engine.lora import LoraGroup, linear_and_shrink, lora_linear
from gpu_runtime.model.llama import CausalLM

FUSED_EXPAND_MAX_ROWS = 64
"""Largest decode batch whose q|k|v and gate|up LoRA expand runs inside RoPE / SwiGLU."""


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
        fuse_lora_expand: bool = True,
        skinny_max_rows: int = 0,
        skinny_projections: Sequence[str] = ("qkv", "o"),
        programmatic_launch_rows: int = 0,
    ) -> None:
        """`lora_groups` (per layer, `LoraRuntime.decode_groups()`): the stacked adapter slots
        added when a call passes `lora_slots`; `fuse_lora_expand`: at batch <=
        `FUSED_EXPAND_MAX_ROWS` add the q|k|v and gate|up terms inside the RoPE and SwiGLU
        kernels instead of separate expand kernels. `skinny_max_rows` (0: off): calls of at
        most that many tokens run `skinny_projections` ("qkv", "o", "gate_up", "down") without
        an adapter group through the split-K Triton GEMM (`skinny_gemm.py`) instead of
        cuBLAS; read at call time (graphs keep what they captured).
        `programmatic_launch_rows` (0: off): calls of at most that many tokens launch their
        Triton kernels as programmatic dependents (`fused_ops`); read at call time too."""
        self.programmatic_launch_rows = programmatic_launch_rows
        self.skinny_max_rows = skinny_max_rows
        self.skinny_projections = frozenset(skinny_projections)
        self.num_sms = 132
        if torch.cuda.is_available():
            self.num_sms = torch.cuda.get_device_properties(
                model.model.embed_tokens.weight.device
            ).multi_processor_count
        self.model = model
        self.lora_groups = lora_groups
        self.fuse_lora_expand = fuse_lora_expand
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
        attention: MixedPagedAttention | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`lora_slots` `[B]` (-1: base row): add each row's adapter slot's LoRA terms per
        adapted projection group: the shrink shares the base GEMM when the slots live in the
        model's fused weights (else its own GEMM); the expand is added inside the RoPE and
        SwiGLU kernels (q|k|v, gate|up; small batches) or by one expand-add kernel. Without it
        the step has exactly the base kernels. Outputs of extended GEMMs are strided views;
        the fused kernels take row strides.

        `attention` (any step: prefill chunks too; positions and cache slots per token): attends
        instead of the one-query-per-row kernel. `logits_rows`: only these rows get logits."""
        model = self.model
        groups = self.lora_groups if lora_slots is not None else None
        slots = lora_slots
        # small batches: q|k|v and gate|up expand terms inside the RoPE and SwiGLU kernels (each
        # row reads its slot's B: rows x R x out bytes); larger: one tl.dot expand kernel
        fuse_expand = self.fuse_lora_expand and input_ids.shape[0] <= FUSED_EXPAND_MAX_ROWS
        batch = input_ids.shape[0]
        skinny = self.skinny_projections if 0 < batch <= self.skinny_max_rows else frozenset()
        pdl = 0 < batch <= self.programmatic_launch_rows
        x = model.model.embed_tokens(input_ids)  # [B, hidden]
        residual: torch.Tensor | None = None
        for index, layer in enumerate(model.decoder_layers):
            attn, mlp = layer.self_attn, layer.mlp
            h, residual = rms_norm(x, layer.input_layernorm.weight, self.eps, residual, pdl)
            lora = groups[index] if groups is not None else None
            qkv_group = _group(lora, "qkv")
            qkv_rows: LoraRows | None = None
            if qkv_group is not None and slots is not None and fuse_expand:
                qkv, shrink = linear_and_shrink(h, attn.qkv_weight, attn.qkv_bias, qkv_group)  # type: ignore[arg-type]
                qkv_rows = LoraRows(shrink, qkv_group.b, slots, qkv_group.max_rank)
            elif qkv_group is None and "qkv" in skinny:
                qkv = self._skinny(h, attn.qkv_weight, attn.qkv_bias)  # type: ignore[arg-type]
            else:
                qkv = lora_linear(h, attn.qkv_weight, attn.qkv_bias, qkv_group, slots)  # type: ignore[arg-type]
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
                qkv_rows,
                pdl,
            )  # [B, H, D]
            if attention is not None:
                out = attention.attend(index, q)
            else:
                out = paged_decode_attention(
                    q,
                    key_cache,
                    value_cache,
                    metadata.block_tables,
                    metadata.seq_lens,
                    self.cache.block_size,
                    num_splits,
                    pdl=pdl,
                )
            o = _group(lora, "o")
            if o is None and "o" in skinny:
                x = self._skinny(out.view(batch, -1), attn.o_proj.weight, attn.o_proj.bias)
            else:
                x = lora_linear(out.view(batch, -1), attn.o_proj.weight, attn.o_proj.bias, o, slots)
            h, residual = rms_norm(
                x, layer.post_attention_layernorm.weight, self.eps, residual, pdl
            )
            gu_group = _group(lora, "gate_up")
            gu_rows: LoraRows | None = None
            if gu_group is not None and slots is not None and fuse_expand:
                gate_up, shrink = linear_and_shrink(h, mlp.gate_up_weight, None, gu_group)  # type: ignore[arg-type]
                gu_rows = LoraRows(shrink, gu_group.b, slots, gu_group.max_rank)
            elif gu_group is None and "gate_up" in skinny:
                gate_up = self._skinny(h, mlp.gate_up_weight, None)  # type: ignore[arg-type]
            else:
                gate_up = lora_linear(h, mlp.gate_up_weight, None, gu_group, slots)  # type: ignore[arg-type]
            act = silu_and_mul(gate_up, gu_rows, pdl)
            down = _group(lora, "down")
            if down is None and "down" in skinny:
                x = self._skinny(act, mlp.down_proj.weight, None)
            else:
                x = lora_linear(act, mlp.down_proj.weight, None, down, slots)
        h, _ = rms_norm(x, model.model.norm.weight, self.eps, residual, pdl)
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)
        return model.compute_logits(h)

    def _skinny(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        from gpu_runtime.engine.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias, num_sms=self.num_sms)


def _group(lora: Mapping[str, LoraGroup] | None, name: str) -> LoraGroup | None:
    return lora.get(name) if lora else None
