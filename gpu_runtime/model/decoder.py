"""The one Llama-family decoder definition (Llama 3, Qwen2/2.5), run over pluggable ops.

Every forward pass of the runtime walks the same structure: embed; per layer, RMSNorm, q/k/v
projection, RoPE and attention, o projection, residual add, RMSNorm, gate/up projection,
SiLU-and-multiply, down projection, residual add; final RMSNorm. That walk is written once,
here (`decoder_layer` and its halves, `DecoderStack.run`, `DecoderStack.layer_output`). What
differs between the paths is only how each step is computed, so each path supplies a
`DecoderOps`:

* `ModuleOps` (`gpu_runtime.model.module_ops`): the layer's own modules and an injected
  attention (dense SDPA or paged); `CausalLM.forward`, and the peft-wrapped training tree.
* the multi-LoRA serving ops (`lora.forward`): the same plus each adapted
  projection's per-token adapter term.
* the fused training ops (`finetune.fused_forward`): fused q|k|v and gate|up GEMMs with one
  shared LoRA shrink and dropout mask per input.
* the fused decode ops (`engine.fast_decode`): Triton add+RMSNorm, RoPE + KV-cache write and
  SiLU-and-multiply kernels, paged decode attention, stacked adapter slots.

Why these seams. The paths differ exactly at the projections (LoRA terms, fused GEMMs, a
shrink sharing the base GEMM), at the norm (a kernel that also does the residual add), at
RoPE + attention (dense, paged, fused with the cache write) and at the activation (a kernel
that also adds the gate|up LoRA expand), and nowhere else. The same seams are where tensor
parallelism shards a layer: q|k|v and gate|up are column-parallel, attention runs on the local
heads, o and down are row-parallel and end in a reduction. The walk itself places the
collectives (`layer.parallel.copy_in` on the normed stream before q|k|v and gate|up,
`reduce_out` after o and down; `gpu_runtime.distributed.parallel`), so every path is tensor
parallel with no change to its ops; at one GPU they are the identity.

Contracts:

* Residual stream. A layer takes and returns `(x, residual)`: `x` the output of the last branch
  (attention or MLP), not yet added; `residual` the stream before it (None before the first
  layer, where `x` is the embedding). `ops.norm(norm, x, residual)` returns the normed sum and
  the sum, so a fused add+norm kernel takes the add; ops that add themselves compute
  `residual + x`, which is bit-identical to `x + branch` (float addition commutes).
* `ops.qkv` returns an ops-specific value (three tensors, or a fused q|k|v with the adapter
  rows its RoPE kernel expands) that only `ops.rope_and_attend` reads; likewise `ops.gate_up`
  for `ops.silu_and_mul`. `rope_and_attend` returns the attention output `[..., H * D]`.
* Per-layer state (the KV cache of layer `index`, its adapter slots) is looked up by `index`;
  per-call state (RoPE cos/sin of the positions, attention metadata, per-token slots) lives in
  the ops object, built per forward. Nothing here holds per-step state.
* Training runs `layer_output` (one layer with its residual added, so one tensor enters each
  layer) over a layer range, each optionally recomputed in backward
  (`finetune.loss.run_layer_range`); serving runs `run`. A layer is `pre_attention` (norm,
  q/k/v), `ops.rope_and_attend`, `post_attention` (o, norm, MLP); a step whose attention runs
  between CUDA graphs (`engine.mixed_graphs`) runs the two halves around it, the final one
  through `final_norm` with the last residual.
* Cost: one method call per step of the walk; no tensor is allocated outside the ops.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.model.modules import MLP, Attention, DecoderLayer, RMSNorm, VocabParallelEmbedding

QKV = TypeVar("QKV")
GateUp = TypeVar("GateUp")


class DecoderOps(Protocol[QKV, GateUp]):
    """The kernels of one forward pass (see the module docstring)."""

    def norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`norm(residual + x)`, `residual + x`); `x` alone when `residual` is None."""
        ...

    def qkv(self, index: int, attn: Attention, h: torch.Tensor) -> QKV:
        """Layer `index`'s q, k, v projections of the normed stream `h` `[..., hidden]`."""
        ...

    def rope_and_attend(self, index: int, attn: Attention, qkv: QKV) -> torch.Tensor:
        """RoPE on q and k, then attention of layer `index`: `[..., H * D]`."""
        ...

    def o(self, index: int, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        """The o projection of the attention output: `[..., hidden]`."""
        ...

    def gate_up(self, index: int, mlp: MLP, h: torch.Tensor) -> GateUp:
        """Layer `index`'s gate and up projections of the normed stream `h`."""
        ...

    def silu_and_mul(self, index: int, gate_up: GateUp) -> torch.Tensor:
        """`silu(gate) * up`: `[..., intermediate]`."""
        ...

    def down(self, index: int, mlp: MLP, act: torch.Tensor) -> torch.Tensor:
        """The down projection: `[..., hidden]`."""
        ...


def pre_attention(
    ops: DecoderOps[QKV, Any],
    index: int,
    layer: DecoderLayer,
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> tuple[QKV, torch.Tensor]:
    """Layer `index` up to its attention: `(x, residual)` in, `(ops.qkv of the normed stream,
    residual stream)` out."""
    h, residual = ops.norm(layer.input_layernorm, x, residual)
    return ops.qkv(index, layer.self_attn, layer.parallel.copy_in(h)), residual


def post_attention(
    ops: DecoderOps[Any, Any],
    index: int,
    layer: DecoderLayer,
    out: torch.Tensor,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index` from its attention output `out` `[..., H * D]` on: `(mlp output, residual
    stream before it)`."""
    parallel = layer.parallel
    x = parallel.reduce_out(ops.o(index, layer.self_attn, out))
    h, residual = ops.norm(layer.post_attention_layernorm, x, residual)
    mlp = layer.mlp
    act = ops.silu_and_mul(index, ops.gate_up(index, mlp, parallel.copy_in(h)))
    return parallel.reduce_out(ops.down(index, mlp, act)), residual


def decoder_layer(
    ops: DecoderOps[Any, Any],
    index: int,
    layer: DecoderLayer,
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index`: `(x, residual)` in, `(mlp output, residual stream before it)` out."""
    qkv, residual = pre_attention(ops, index, layer, x, residual)
    out = ops.rope_and_attend(index, layer.self_attn, qkv)
    return post_attention(ops, index, layer, out, residual)


class DecoderStack(nn.Module):
    """`model.*` of the HF layout: embeddings, layers, final norm; and the walk over them.

    `config` has this rank's shapes; `parallel` and `vocab_start` place it in its
    tensor-parallel group (the defaults: one GPU, the whole model).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: TensorParallel = SINGLE,
        vocab_start: int = 0,
        **factory: Any,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, parallel, vocab_start, **factory
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, parallel, **factory) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)

    def run(self, ops: DecoderOps[Any, Any], input_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states `input_ids.shape + [hidden]`; the residual stream is
        handed from layer to layer unadded (`ops.norm` adds it)."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(cast(Iterable[DecoderLayer], self.layers)):
            x, residual = decoder_layer(ops, index, layer, x, residual)
        return self.final_norm(ops, x, residual)

    def layer_output(self, ops: DecoderOps[Any, Any], index: int, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer `index` from the stream `x` before it: the unit
        the trainer recomputes (one input tensor per layer) and slices quanta at."""
        out, residual = decoder_layer(ops, index, cast(DecoderLayer, self.layers[index]), x, None)
        return residual + out

    def final_norm(
        self, ops: DecoderOps[Any, Any], x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final RMSNorm of the residual stream `residual + x` (`x` alone without one)."""
        h, _ = ops.norm(self.norm, x, residual)
        return h
