"""The runner's general step path, for steps `ModelRunner._forward` does not send down the
decode fast path (prefill chunks, batches past the largest bucket, static decode off): the
step's tokens flattened in batch order, their attention (`MixedPagedAttention`, or
`TorchPagedAttention` with `EngineConfig.mixed_batch_attention` resolved off), the model, its
LoRA forward or the fused CUDA step over them, and the replay of such steps from the piecewise
mixed-step graphs.

`GeneralPath` is held by `ModelRunner`; each call takes the runner's request states, and it reads
the runner's block-table rows (`block_table_rows`, written by the runner). It owns the mixed-step
graphs and never changes request state.
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
from gpu_runtime.engine.runner_types import _RequestState
from gpu_runtime.lora.protocol import LoraForward, LoraRuntime
from gpu_runtime.model.llama import CausalLM

if TYPE_CHECKING:
    from gpu_runtime.engine.fast_decode import FusedDecodeForward as FusedDecodeForwardType
    from gpu_runtime.engine.mixed_graphs import MixedStepGraphs


class GeneralPath:
    """Steps off the decode fast path, flattened; see the module doc."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        config: EngineConfig,
        block_table_rows: torch.Tensor,
        fused: FusedDecodeForwardType | None,
        mixed_graphs: MixedStepGraphs | None,
        lora: LoraRuntime | None,
        num_sms: int,
    ) -> None:
        """`block_table_rows` `[rows, max_blocks_per_seq]` int32 on the host: the runner's
        block table per request row (kept current by the runner); `fused`: the fused CUDA step
        (None: the model's own forward); `mixed_graphs`: piecewise graphs of the fused step
        per token bucket (None: such steps run eagerly)."""
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.lora = lora
        self.fused = fused
        self.mixed_graphs = mixed_graphs
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.use_triton = config.resolved_attention_backend == "triton"
        self.num_sms = num_sms
        self._table_cpu = block_table_rows
        self.mixed_attention = config.resolved_mixed_batch_attention
        """Attention of flattened steps: `MixedPagedAttention` (True) or per-sequence gather +
        SDPA (`TorchPagedAttention`); benchmarks switch it at run time."""
        self.use_mixed_graphs = True
        """Replay captured mixed-step graphs (`EngineConfig.mixed_cuda_graphs`); False runs
        such steps eagerly (benchmarks compare both)."""
        self.num_mixed_graph_steps = 0
        """Steps with prefill chunks replayed from the piecewise mixed-step graphs."""

    def step_logits(
        self,
        order: list[tuple[str, int]],
        states: dict[str, _RequestState],
        partition: Hashable,
        with_adapters: bool,
        extra_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[str]]:
        """Logits `[sampled, vocab]` of a step in `order` (ids and token counts; `states` the
        runner's request states) and the sampled ids: on CUDA through the fused step (replayed
        from the mixed-step graphs when captured, without adapters and `extra_rows`), else the
        model's or the LoRA runtime's forward. `extra_rows`: flattened token indices whose
        logits follow the sampled rows' (`[sampled + len(extra_rows), vocab]`; prompt
        logprobs)."""
        if self.fused is not None and self.mixed_attention:  # CUDA: the fused step
            if (
                not with_adapters
                and extra_rows is None
                and self.mixed_graphs is not None
                and self.use_mixed_graphs
            ):
                replayed = self.mixed_graph_logits(order, states, partition)
                if replayed is not None:
                    return replayed
            return self.logits(order, states, self.model, with_adapters, extra_rows)
        lora = self.lora
        use_lora = with_adapters and lora is not None and lora.set_batch(order)
        forward = lora.forward if use_lora and lora is not None else self.model
        return self.logits(order, states, forward, extra_rows=extra_rows)

    def attention(self, flat: FlatBatch) -> MixedPagedAttention:
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
            kv_heads = self.model.local_config.num_key_value_heads
            decode_fn = paged_decode_fn(self.block_size, rows, kv_heads, self.num_sms)
        return MixedPagedAttention(self.kv_cache, metadata, decode_fn, compute_dtype, varlen_fn)

    def mixed_graph_logits(
        self,
        order: list[tuple[str, int]],
        states: dict[str, _RequestState],
        partition: Hashable,
    ) -> tuple[torch.Tensor, list[str]] | None:
        """A step with prefill chunks through the piecewise graphs of its token bucket, or
        None when that bucket is not captured for `partition`."""
        mixed = self.mixed_graphs
        assert mixed is not None
        bucket = mixed.bucket_for(sum(count for _, count in order))
        if bucket is None or not mixed.has(bucket, partition):
            return None
        flat = flatten_step(order, states, self.block_size)
        if len(flat.sample_index) > mixed.rows_for(bucket):
            return None
        logits = mixed.run(flat, self.attention(flat), bucket, partition)
        self.num_mixed_graph_steps += 1
        return logits, flat.sampled_ids

    def logits(
        self,
        order: list[tuple[str, int]],
        states: dict[str, _RequestState],
        forward: LoraForward | CausalLM,
        fused_lora: bool | None = None,
        extra_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[str]]:
        """Flattened tokens of `order` through `forward` (the model, or the LoRA forward after
        `set_batch(order)`); logits `[sampled, vocab]` and the sampled ids. `fused_lora` not
        None: through the fused CUDA step instead (with per-token LoRA slots when True).
        `extra_rows`: as in `step_logits`."""
        flat = flatten_step(order, states, self.block_size, bool(fused_lora))
        dev = self.device
        attention: MixedPagedAttention | TorchPagedAttention
        if self.mixed_attention:
            attention = self.attention(flat)
            metadata = attention.metadata
        else:
            metadata = flat.metadata(self._table_cpu, dev)
            attention = TorchPagedAttention(self.kv_cache, metadata, torch_compute_dtype(dev))
        ids = torch.tensor(flat.tokens, device=dev)
        positions = torch.tensor(flat.positions, device=dev)
        rows = flat.sample_index + extra_rows if extra_rows else flat.sample_index
        index = torch.tensor(rows, dtype=torch.long, device=dev)
        if fused_lora is not None and self.fused is not None:
            assert isinstance(attention, MixedPagedAttention)
            slots = torch.tensor(flat.token_slots, device=dev) if fused_lora else None
            logits = self.fused(ids, positions, metadata, 1, slots, attention, index)
            return logits, flat.sampled_ids
        hidden = forward(ids, positions, attention)
        return self.model.compute_logits(hidden.index_select(0, index)), flat.sampled_ids
