"""The CUDA decode step over a `CausalLM`'s own weights, with fused Triton kernels.

The model's own decoder walk (`DecoderStack.run`) over `FusedDecodeOps`: same math as
`CausalLM.forward` + `compute_logits` for one token per sequence (checked against it in the GPU
tests), in about ten kernels per layer instead of about thirty-five: the step is short enough
that launches, not bytes, would otherwise dominate at small batch. The residual add rides in the
RMSNorm kernel (`fused_ops.rms_norm`), the K/V cache write in the RoPE kernel, the q|k|v and
gate|up LoRA expand (small batches) in the RoPE and SwiGLU kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.mixed import MixedPagedAttention
from gpu_runtime.engine.attention.triton_decode import paged_decode_attention
from gpu_runtime.engine.fused_ops import LoraRows, rms_norm, rope_and_cache_write, silu_and_mul
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.lora.groups import LoraGroup
from gpu_runtime.lora.linear import linear_and_shrink, lora_linear
from gpu_runtime.model.llama import CausalLM
from gpu_runtime.model.modules import MLP, Attention, RMSNorm

FUSED_EXPAND_MAX_ROWS = 64
"""Largest decode batch whose q|k|v and gate|up LoRA expand runs inside RoPE / SwiGLU."""

LayerLoraGroups = tuple[LoraGroup | None, LoraGroup | None, LoraGroup | None, LoraGroup | None]
"""One layer's adapter groups in `(qkv, o, gate_up, down)` order (None: not adapted)."""

Attend = Callable[[int, torch.Tensor], torch.Tensor]
"""Layer `index`'s attention of rotated queries `[B, H, D]` (K/V cached) -> `[B, H, D]`."""

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
        programmatic_launch_rows: int = 0,
    ) -> None:
        """`lora_groups` (per layer, `LoraRuntime.decode_groups()`): the stacked adapter slots
        added when a call passes `lora_slots`; `fuse_lora_expand`: at batch <=
        `FUSED_EXPAND_MAX_ROWS` add the q|k|v and gate|up terms inside the RoPE and SwiGLU
        kernels instead of separate expand kernels. `programmatic_launch_rows` (0: off): calls
        of at most that many tokens launch their Triton kernels as programmatic dependents
        (`fused_ops`); read at call time (graphs keep what they captured)."""
        self.programmatic_launch_rows = programmatic_launch_rows
        self.model = model
        self.lora_groups = lora_groups
        self.fuse_lora_expand = fuse_lora_expand
        self.cache = cache
        config = model.local_config  # this rank's heads under tensor parallelism
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
        pdl = 0 < input_ids.shape[0] <= self.programmatic_launch_rows
        attend: Attend = (
            attention.attend
            if attention is not None
            else PagedDecodeAttention(self.cache, metadata, num_splits, pdl).attend
        )
        ops = FusedDecodeOps(
            self, positions, metadata.slot_blocks, metadata.slot_offsets, attend, lora_slots, pdl
        )
        h = model.model.run(ops, input_ids)
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)
        return model.compute_logits(h)


class PagedDecodeAttention:
    """One query per row over the paged cache (`paged_decode_attention`) for one call."""

    def __init__(
        self, cache: PagedKVCache, metadata: AttentionMetadata, num_splits: int, pdl: bool
    ) -> None:
        self.cache = cache
        self.metadata = metadata
        self.num_splits = num_splits
        self.pdl = pdl

    def attend(self, index: int, q: torch.Tensor) -> torch.Tensor:
        """Rotated queries `[B, H, D]` of layer `index` -> `[B, H, D]`."""
        cache, metadata = self.cache, self.metadata
        return paged_decode_attention(
            q,
            cache.key_caches[index],
            cache.value_caches[index],
            metadata.block_tables,
            metadata.seq_lens,
            cache.block_size,
            self.num_splits,
            pdl=self.pdl,
        )


class FusedDecodeOps:
    """`DecoderOps` of one call of the fused step over `B` tokens (`FusedDecodeForward.__call__`;
    the mixed-step graphs run its halves around an attention outside the graphs).

    Per call: the tokens' positions `[B]` and cache slots (`slot_blocks`, `slot_offsets` `[B]`),
    the attention (`attend(index, rotated q [B, H, D]) -> [B, H, D]`; None: only
    `rope_and_cache_write` is called), the per-row LoRA slots (None: the base kernels only),
    whether the Triton kernels launch as programmatic dependents (`pdl`), and the in-kernel
    LoRA expand choice that depends on B, made once here, not per layer.
    """

    def __init__(
        self,
        step: FusedDecodeForward,
        positions: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        attend: Attend | None,
        lora_slots: torch.Tensor | None = None,
        pdl: bool = False,
    ) -> None:
        self.step = step
        self.cache = step.cache
        self.positions = positions
        self.slot_blocks = slot_blocks
        self.slot_offsets = slot_offsets
        self.attend = attend
        self.eps = step.eps
        self.groups = step.layer_groups if lora_slots is not None else step.base_groups
        self.slots = lora_slots
        self.batch = batch = positions.shape[0]
        # small batches: q|k|v and gate|up expand terms inside the RoPE and SwiGLU kernels (each
        # row reads its slot's B: rows x R x out bytes); larger: one tl.dot expand kernel
        self.fuse_expand = step.fuse_lora_expand and batch <= FUSED_EXPAND_MAX_ROWS
        self.pdl = pdl

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
        return lora_linear(h, weight, bias, group, slots), None

    def rope_and_cache_write(self, index: int, qkv: ProjectionRows) -> torch.Tensor:
        """RoPE on q and k of layer `index`, k and v written to its cache: rotated q
        `[B, H, D]`."""
        step = self.step
        return rope_and_cache_write(
            qkv[0],
            self.positions,
            step.cos,
            step.sin,
            self.cache.key_caches[index],
            self.cache.value_caches[index],
            self.slot_blocks,
            self.slot_offsets,
            step.num_heads,
            step.num_kv_heads,
            step.head_dim,
            qkv[1],
            self.pdl,
        )

    def rope_and_attend(self, index: int, attn: Attention, qkv: ProjectionRows) -> torch.Tensor:
        assert self.attend is not None
        out = self.attend(index, self.rope_and_cache_write(index, qkv))
        return out.view(self.batch, -1)

    def o(self, index: int, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        weight, bias = attn.o_proj.weight, attn.o_proj.bias
        return lora_linear(out, weight, bias, self.groups[index][1], self.slots)

    def gate_up(self, index: int, mlp: MLP, h: torch.Tensor) -> ProjectionRows:
        """gate|up `[B, 2 I]`; the adapter rows, when the SwiGLU kernel adds the expand."""
        weight = mlp.gate_up_weight
        assert weight is not None
        group, slots = self.groups[index][2], self.slots
        if group is not None and slots is not None and self.fuse_expand:
            gate_up, shrink = linear_and_shrink(h, weight, None, group)
            return gate_up, LoraRows(shrink, group.b, slots, group.max_rank)
        return lora_linear(h, weight, None, group, slots), None

    def silu_and_mul(self, index: int, gate_up: ProjectionRows) -> torch.Tensor:
        return silu_and_mul(gate_up[0], gate_up[1], self.pdl)

    def down(self, index: int, mlp: MLP, act: torch.Tensor) -> torch.Tensor:
        return lora_linear(act, mlp.down_proj.weight, None, self.groups[index][3], self.slots)


def _group(lora: Mapping[str, LoraGroup] | None, name: str) -> LoraGroup | None:
    return lora.get(name) if lora else None
