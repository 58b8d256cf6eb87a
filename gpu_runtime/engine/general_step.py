"""The runner's general step path, for steps `ModelRunner._forward` does not send down the
decode fast path (prefill chunks, batches past the largest bucket, static decode off): the
step's tokens flattened in batch order, their attention (`MixedPagedAttention`, or
`TorchPagedAttention` with `EngineConfig.mixed_batch_attention` resolved off), the model, its
LoRA forward or the fused CUDA step over them, and the replay of such steps from the piecewise
mixed-step graphs.

`GeneralStepMixin` is part of `ModelRunner` (split out by role); it reads the runner's model,
KV cache, request states, block-table rows and config, and its mixed-step graphs.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from gpu_runtime.engine.attention.mixed import MixedPagedAttention
from gpu_runtime.engine.attention.torch_paged import TorchPagedAttention, torch_compute_dtype
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.flat_batch import FlatBatch, flatten_step
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.engine.lora import LoraForward
from gpu_runtime.engine.runner_types import _RequestState
from gpu_runtime.model.llama import CausalLM

if TYPE_CHECKING:
    from gpu_runtime.engine.fast_decode import FusedDecodeForward as FusedDecodeForwardType
    from gpu_runtime.engine.mixed_graphs import MixedStepGraphs


class GeneralStepMixin:
    """Steps off the decode fast path, flattened; see the module doc."""

    # set by ModelRunner.__init__
    config: EngineConfig
    model: CausalLM
    device: torch.device
    kv_cache: PagedKVCache
    block_size: int
    states: dict[str, _RequestState]
    use_triton: bool
    mixed_attention: bool
    num_mixed_graph_steps: int
    _num_sms: int
    _table_cpu: torch.Tensor
    _fused: FusedDecodeForwardType | None
    _mixed: MixedStepGraphs | None

    def _mixed_attention(self, flat: FlatBatch) -> MixedPagedAttention:
        """Attention of a flattened step (decode rows in one Triton call on CUDA)."""
        dev = self.device
        metadata = flat.metadata(self._table_cpu, dev)
        compute_dtype = torch_compute_dtype(dev)
        decode_fn = varlen_fn = None
        if self.use_triton and self.config.chunk_attention == "varlen":
            from gpu_runtime.engine.attention.triton_varlen import triton_varlen_fn

            varlen_fn = triton_varlen_fn(self.block_size)
        if self.use_triton:
            from gpu_runtime.engine.attention.triton_decode import paged_decode_fn

            rows = sum(1 for n in flat.query_lens if n == 1)
            kv_heads = self.model.config.num_key_value_heads
            decode_fn = paged_decode_fn(self.block_size, rows, kv_heads, self._num_sms)
        return MixedPagedAttention(self.kv_cache, metadata, decode_fn, compute_dtype, varlen_fn)

    def _mixed_graph_logits(
        self, order: list[tuple[str, int]], partition: Hashable
    ) -> tuple[torch.Tensor, list[str]] | None:
        """A step with prefill chunks through the piecewise graphs of its token bucket, or
        None when that bucket is not captured for `partition`."""
        mixed = self._mixed
        assert mixed is not None
        bucket = mixed.bucket_for(sum(count for _, count in order))
        if bucket is None or not mixed.has(bucket, partition):
            return None
        flat = flatten_step(order, self.states, self.block_size)
        if len(flat.sample_index) > mixed.rows_for(bucket):
            return None
        logits = mixed.run(flat, self._mixed_attention(flat), bucket, partition)
        self.num_mixed_graph_steps += 1
        return logits, flat.sampled_ids

    def _general_logits(
        self,
        order: list[tuple[str, int]],
        forward: LoraForward | CausalLM,
        fused_lora: bool | None = None,
    ) -> tuple[torch.Tensor, list[str]]:
        """Flattened tokens of `order` through `forward` (the model, or the LoRA forward after
        `set_batch(order)`); logits `[sampled, vocab]` and the sampled ids. `fused_lora` not
        None: through the fused CUDA step instead (with per-token LoRA slots when True)."""
        flat = flatten_step(order, self.states, self.block_size, bool(fused_lora))
        dev = self.device
        attention: MixedPagedAttention | TorchPagedAttention
        if self.mixed_attention:
            attention = self._mixed_attention(flat)
            metadata = attention.metadata
        else:
            metadata = flat.metadata(self._table_cpu, dev)
            attention = TorchPagedAttention(self.kv_cache, metadata, torch_compute_dtype(dev))
        ids = torch.tensor(flat.tokens, device=dev)
        positions = torch.tensor(flat.positions, device=dev)
        index = torch.tensor(flat.sample_index, dtype=torch.long, device=dev)
        if fused_lora is not None and self._fused is not None:
            assert isinstance(attention, MixedPagedAttention)
            slots = torch.tensor(flat.token_slots, device=dev) if fused_lora else None
            logits = self._fused(ids, positions, metadata, 1, slots, attention, index)
            return logits, flat.sampled_ids
        hidden = forward(ids, positions, attention)
        return self.model.compute_logits(hidden.index_select(0, index)), flat.sampled_ids
