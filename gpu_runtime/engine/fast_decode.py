"""The CUDA decode step over a `CausalLM`'s own weights, with fused Triton kernels.

The model's own decoder walk (`DecoderStack.run`) over `FusedDecodeOps`: same math as
`CausalLM.forward` + `compute_logits` for one token per sequence (checked against it in the GPU
tests), in about ten kernels per layer instead of about thirty-five: the step is short enough
that launches, not bytes, would otherwise dominate at small batch. The residual add rides in the
RMSNorm kernel (`fused_ops.rms_norm`), the K/V cache write in the RoPE kernel, the q|k|v and
gate|up LoRA expand (small batches) in the RoPE and SwiGLU kernels.
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
from gpu_runtime.model.modules import MLP, Attention, RMSNorm

FUSED_EXPAND_MAX_ROWS = 64
"""Largest decode batch whose q|k|v and gate|up LoRA expand runs inside RoPE / SwiGLU."""

LayerLoraGroups = tuple[LoraGroup | None, LoraGroup | None, LoraGroup | None, LoraGroup | None]
"""One layer's adapter groups in `(qkv, o, gate_up, down)` order (None: not adapted)."""

ProjectionRows = tuple[torch.Tensor, LoraRows | None]
"""A fused projection's output `[B, out]` and the LoRA rows its consuming kernel expands."""


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
        # per layer: the (qkv, o, gate_up, down) adapter groups, None where not adapted; the
        # base step reads all None
        self.base_groups: list[LayerLoraGroups] = [(None, None, None, None)] * len(
            model.decoder_layers
        )
        self.layer_groups = self.base_groups
        if lora_groups is not None:
            self.layer_groups = [
                (_group(g, "qkv"), _group(g, "o"), _group(g, "gate_up"), _group(g, "down"))
                for g in lora_groups
            ]

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
        batch = input_ids.shape[0]
        ops = FusedDecodeOps(self, batch, positions, metadata, num_splits, lora_slots, attention)
        h = model.model.run(ops, input_ids)
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)
        return model.compute_logits(h)

    def skinny(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`F.linear` through the split-K Triton GEMM (`skinny_gemm.py`)."""
        from gpu_runtime.engine.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias, num_sms=self.num_sms)


class FusedDecodeOps:
    """`DecoderOps` of one call of `FusedDecodeForward` (see `FusedDecodeForward.__call__`).

    Per call: the batch size B, the tokens' positions `[B]`, the attention metadata, the per-row
    LoRA slots, and the choices that depend on the batch size (in-kernel LoRA expand, split-K
    GEMMs, programmatic launch), made once here, not per layer.
    """

    def __init__(
        self,
        step: FusedDecodeForward,
        batch: int,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        num_splits: int,
        lora_slots: torch.Tensor | None,
        attention: MixedPagedAttention | None,
    ) -> None:
        self.step = step
        self.cache = step.cache
        self.positions = positions
        self.metadata = metadata
        self.num_splits = num_splits
        self.attention = attention
        self.eps = step.eps
        self.groups = step.layer_groups if lora_slots is not None else step.base_groups
        self.slots = lora_slots
        self.batch = batch
        # small batches: q|k|v and gate|up expand terms inside the RoPE and SwiGLU kernels (each
        # row reads its slot's B: rows x R x out bytes); larger: one tl.dot expand kernel
        self.fuse_expand = step.fuse_lora_expand and batch <= FUSED_EXPAND_MAX_ROWS
        self.skinny_projections = (
            step.skinny_projections if 0 < batch <= step.skinny_max_rows else frozenset()
        )
        self.pdl = 0 < batch <= step.programmatic_launch_rows

    def norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, norm.weight, self.eps, residual, self.pdl)

    def qkv(self, index: int, attn: Attention, h: torch.Tensor) -> ProjectionRows:
        """q|k|v `[B, (H + 2 KV) D]`; the adapter rows, when the RoPE kernel adds the expand."""
        weight, bias = attn.qkv_weight, attn.qkv_bias
        assert weight is not None
        group, slots = self.groups[index][0], self.slots
        if group is not None and slots is not None and self.fuse_expand:
            qkv, shrink = linear_and_shrink(h, weight, bias, group)
            return qkv, LoraRows(shrink, group.b, slots, group.max_rank)
        if group is None and "qkv" in self.skinny_projections:
            return self.step.skinny(h, weight, bias), None
        return lora_linear(h, weight, bias, group, slots), None

    def rope_and_attend(self, index: int, attn: Attention, qkv: ProjectionRows) -> torch.Tensor:
        step, metadata = self.step, self.metadata
        key_cache = self.cache.key_caches[index]
        value_cache = self.cache.value_caches[index]
        q = rope_and_cache_write(
            qkv[0],
            self.positions,
            step.cos,
            step.sin,
            key_cache,
            value_cache,
            metadata.slot_blocks,
            metadata.slot_offsets,
            step.num_heads,
            step.num_kv_heads,
            step.head_dim,
            qkv[1],
            self.pdl,
        )  # [B, H, D]
        if self.attention is not None:
            out = self.attention.attend(index, q)
        else:
            out = paged_decode_attention(
                q,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                self.cache.block_size,
                self.num_splits,
                pdl=self.pdl,
            )
        return out.view(self.batch, -1)

    def o(self, index: int, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        weight, bias = attn.o_proj.weight, attn.o_proj.bias
        group = self.groups[index][1]
        if group is None and "o" in self.skinny_projections:
            return self.step.skinny(out, weight, bias)
        return lora_linear(out, weight, bias, group, self.slots)

    def gate_up(self, index: int, mlp: MLP, h: torch.Tensor) -> ProjectionRows:
        """gate|up `[B, 2 I]`; the adapter rows, when the SwiGLU kernel adds the expand."""
        weight = mlp.gate_up_weight
        assert weight is not None
        group, slots = self.groups[index][2], self.slots
        if group is not None and slots is not None and self.fuse_expand:
            gate_up, shrink = linear_and_shrink(h, weight, None, group)
            return gate_up, LoraRows(shrink, group.b, slots, group.max_rank)
        if group is None and "gate_up" in self.skinny_projections:
            return self.step.skinny(h, weight, None), None
        return lora_linear(h, weight, None, group, slots), None

    def silu_and_mul(self, index: int, gate_up: ProjectionRows) -> torch.Tensor:
        return silu_and_mul(gate_up[0], gate_up[1], self.pdl)

    def down(self, index: int, mlp: MLP, act: torch.Tensor) -> torch.Tensor:
        weight = mlp.down_proj.weight
        group = self.groups[index][3]
        if group is None and "down" in self.skinny_projections:
            return self.step.skinny(act, weight, None)
        return lora_linear(act, weight, None, group, self.slots)


def _group(lora: Mapping[str, LoraGroup] | None, name: str) -> LoraGroup | None:
    return lora.get(name) if lora else None
