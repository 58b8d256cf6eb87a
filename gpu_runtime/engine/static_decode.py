"""The runner's decode fast path: fixed-shape buffers padded to a batch bucket, the decode step
over them (fused CUDA kernels, Triton attention, or torch attention on CPU), its CUDA graphs per
(bucket, partition), and the LoRA variant of each.

`DecodePath` owns the staging and static buffers and the decode graphs; `ModelRunner` holds one
when static decode batches are on and sends it the decode-only steps that fit a bucket. It reads
the runner's block-table rows (`block_table_rows`, written by the runner) and never changes
request state.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.torch_paged import TorchPagedAttention, torch_compute_dtype
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.cuda_graphs import DecodeGraphs
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.engine.runner_types import _PADDING_ID, PendingTokens, _RequestState
from gpu_runtime.lora.protocol import LoraForward, LoraRuntime
from gpu_runtime.model.llama import CausalLM

if TYPE_CHECKING:
    from gpu_runtime.engine.fast_decode import FusedDecodeForward as FusedDecodeForwardType


class DecodePath:
    """Decode-only steps over static buffers (what CUDA graphs replay); see the module doc."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        config: EngineConfig,
        block_table_rows: np.ndarray,
        fused: FusedDecodeForwardType | None,
        lora: LoraRuntime | None,
        num_sms: int,
    ) -> None:
        """`block_table_rows` `[rows, max_blocks_per_seq]` int32: the runner's block table per
        request row (a numpy view it keeps current); `fused`: the fused CUDA decode step, or
        None (Triton or torch attention under the model's own forward)."""
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.lora = lora
        self.fused = fused
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.use_triton = config.resolved_attention_backend == "triton"
        self.buckets = config.graph_batch_sizes()
        self.num_sms = num_sms
        self._table_np = block_table_rows
        self.graphs: DecodeGraphs | None = None
        self.lora_graphs: DecodeGraphs | None = None
        self.num_static_decode_steps = 0
        self.num_lora_graph_steps = 0
        """Decode steps with adapters replayed from a LoRA graph."""
        size = self.buckets[-1]
        dev = self.device
        pin = dev.type == "cuda"
        width = config.max_blocks_per_seq
        # Two sets of pinned staging buffers, used in turn by successive steps: a step may be
        # launched before the previous one's copies ran (`ModelRunner.launch`), and must not
        # overwrite them. Rows of `ints`: token id, position, slot block, slot offset, LoRA
        # slot (-1: base); `source`: rows taking their token from the device, and where from.
        self._staging = [
            (
                torch.zeros(5, size, dtype=torch.int64, pin_memory=pin),
                torch.zeros(size, dtype=torch.int32, pin_memory=pin),
                torch.zeros(size, width, dtype=torch.int32, pin_memory=pin),
                torch.zeros(2, size, dtype=torch.int64, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._staging_parity = 1
        self._buf_source = torch.zeros(2, size, dtype=torch.int64, device=dev)
        self._use_staging_set()
        self.buf_ints = torch.zeros(5, size, dtype=torch.int64, device=dev)
        """Static inputs `[5, max_bucket]`: token id, position, slot block, slot offset, LoRA
        slot (what the graphs read)."""
        self.buf_ints[2].fill_(kv_cache.pad_block)
        self.buf_ints[4].fill_(-1)
        self.buf_seq_lens = torch.zeros(size, dtype=torch.int32, device=dev)
        self.buf_table = torch.zeros(size, width, dtype=torch.int32, device=dev)

    def _use_staging_set(self) -> None:
        """Switch to the other set of pinned staging buffers (and their numpy views)."""
        self._staging_parity ^= 1
        ints, seq_lens, table, source = self._staging[self._staging_parity]
        self._stage_ints, self._stage_seq_lens, self._stage_table = ints, seq_lens, table
        self._stage_source = source
        # numpy views of the pinned staging buffers (shared memory) for vectorised filling
        self._stage_ints_np = ints.numpy()
        self.stage_seq_lens_np = seq_lens.numpy()
        self._stage_table_np = table.numpy()

    @property
    def max_bucket(self) -> int:
        """Largest decode batch the bucketed path takes."""
        return self.buckets[-1]

    @property
    def fused_lora_decode(self) -> bool:
        """Decode steps with adapters run the fused (graph-captured) LoRA step."""
        return self.fused is not None and self.fused.lora_groups is not None

    def decode_forward_lora(self, bucket: int) -> torch.Tensor:
        """Logits `[bucket, vocab]` of the fused decode step plus each row's LoRA terms (the
        rows' slots are read from the static buffer; graph body)."""
        assert self.fused is not None
        from gpu_runtime.engine.attention.triton_decode import choose_num_splits

        metadata = AttentionMetadata(
            slot_blocks=self.buf_ints[2, :bucket],
            slot_offsets=self.buf_ints[3, :bucket],
            seq_lens=self.buf_seq_lens[:bucket],
            block_tables=self.buf_table[:bucket],
        )
        kv_heads = self.model.local_config.num_key_value_heads
        splits = choose_num_splits(bucket, kv_heads, self.num_sms)
        ids, positions = self.buf_ints[0, :bucket], self.buf_ints[1, :bucket]
        return self.fused(ids, positions, metadata, splits, self.buf_ints[4, :bucket])

    def decode_forward(self, bucket: int, forward: LoraForward | None = None) -> torch.Tensor:
        """Logits `[bucket, vocab]` of a decode step over the static buffers (graph body).

        `forward` replaces the model's forward (the LoRA forward; never the fused kernels)."""
        model_forward = forward if forward is not None else self.model
        metadata = AttentionMetadata(
            slot_blocks=self.buf_ints[2, :bucket],
            slot_offsets=self.buf_ints[3, :bucket],
            seq_lens=self.buf_seq_lens[:bucket],
            block_tables=self.buf_table[:bucket],
        )
        if not self.use_triton:  # same buffers, torch attention (CPU coverage of the staging)
            metadata.query_lens_host = [1] * bucket
            metadata.seq_lens_host = self.stage_seq_lens_np[:bucket].tolist()
            dtype = torch_compute_dtype(self.device)
            reference = TorchPagedAttention(self.kv_cache, metadata, dtype)
            hidden = model_forward(self.buf_ints[0, :bucket], self.buf_ints[1, :bucket], reference)
            return self.model.compute_logits(hidden)
        from gpu_runtime.engine.attention.triton_decode import (
            TritonDecodeAttention,
            choose_num_splits,
        )

        kv_heads = self.model.local_config.num_key_value_heads
        splits = choose_num_splits(bucket, kv_heads, self.num_sms)
        if self.fused is not None and forward is None:
            return self.fused(
                self.buf_ints[0, :bucket], self.buf_ints[1, :bucket], metadata, splits
            )
        attention = TritonDecodeAttention(self.kv_cache, metadata, splits)
        hidden = model_forward(self.buf_ints[0, :bucket], self.buf_ints[1, :bucket], attention)
        return self.model.compute_logits(hidden)

    def graph_sizes(self, batch_sizes: tuple[int, ...] | None) -> list[int]:
        """The buckets to capture, largest first (all of them for None); ValueError for a size
        that is not a bucket."""
        sizes = sorted(batch_sizes or self.buckets, reverse=True)
        for size in sizes:
            if size not in self.buckets:
                raise ValueError(f"batch size {size} is not a bucket of {self.buckets}")
        return sizes

    def capture(
        self, sizes: list[int], partition: Hashable, stream: torch.cuda.Stream | None
    ) -> None:
        """Capture the decode step of each of `sizes` for `partition` on `stream` (with a
        LoRA runtime on the fused path, the LoRA step too: same buckets, same pool). The
        caller sets the GEMM library and SM target and pauses collections around it."""
        if self.graphs is None:
            self.graphs = DecodeGraphs(self.decode_forward)
            if self.fused_lora_decode:
                self.lora_graphs = DecodeGraphs(self.decode_forward_lora, self.graphs)
        for size in sizes:
            self.graphs.capture(size, partition, stream)
            if self.lora_graphs is not None:
                self.lora_graphs.capture(size, partition, stream)

    def drop_graphs(self) -> None:
        """Forget the captured decode graphs (the next `capture` starts a new pool)."""
        self.graphs = self.lora_graphs = None

    def logits(
        self,
        states: list[_RequestState],
        partition: Hashable,
        lora_order: list[tuple[str, int]] | None = None,
        pending: PendingTokens | None = None,
    ) -> tuple[torch.Tensor, int, bool]:
        """Stage one decode token per state (vectorised), copy, replay; logits `[B, V]`.
        With `lora_order` (the step's order, some request has an adapter) the step replays the
        LoRA graph (rows' slots staged with the inputs; padding rows have slot -1), or without
        the fused kernels runs the LoRA forward eagerly over the same buffers."""
        self._use_staging_set()
        batch = len(states)
        bucket = next(b for b in self.buckets if b >= batch)
        bs = self.block_size
        rows = np.fromiter((s.row for s in states), np.int64, batch)
        pos = np.fromiter((s.num_computed_tokens for s in states), np.int64, batch)
        ints = self._stage_ints_np
        ints[0, :batch] = np.fromiter((s.token_ids[-1] for s in states), np.int64, batch)
        ints[1, :batch] = pos
        ints[2, :batch] = self._table_np[rows, pos // bs]
        ints[3, :batch] = pos % bs
        ints[:, batch:bucket] = 0
        ints[2, batch:bucket] = self.kv_cache.pad_block
        fused_lora = lora_order is not None and self.fused_lora_decode
        if fused_lora:
            ints[4, :batch] = np.fromiter((s.lora_slot for s in states), np.int64, batch)
            ints[4, batch:bucket] = -1
        seq_lens = self.stage_seq_lens_np
        seq_lens[:batch] = pos + 1
        seq_lens[batch:bucket] = 0  # padded slots attend to nothing
        np.take(self._table_np, rows, axis=0, out=self._stage_table_np[:batch])
        self.buf_ints[:, :bucket].copy_(self._stage_ints[:, :bucket], non_blocking=True)
        self.buf_seq_lens[:bucket].copy_(self._stage_seq_lens[:bucket], non_blocking=True)
        self.buf_table[:bucket].copy_(self._stage_table[:bucket], non_blocking=True)
        if pending is not None:  # last tokens still on the device: gather them there
            self._gather_pending_tokens(pending)
        self.num_static_decode_steps += 1
        graphs = self.graphs
        lora = self.lora
        lora_graphs = self.lora_graphs
        padded = not fused_lora and lora_order and [*lora_order, (_PADDING_ID, bucket - batch)]
        if fused_lora and lora_graphs is not None and lora_graphs.has(bucket, partition):
            logits = lora_graphs.replay(bucket, partition)
            used = True
            self.num_lora_graph_steps += 1
        elif fused_lora:
            logits = self.decode_forward_lora(bucket)
            used = False
        elif padded and lora is not None and lora.set_batch(padded):
            logits = self.decode_forward(bucket, lora.forward)
            used = False
        elif graphs is not None and graphs.has(bucket, partition):
            logits = graphs.replay(bucket, partition)
            used = True
        else:
            logits = self.decode_forward(bucket)
            used = False
        return logits[:batch], bucket, used

    def _gather_pending_tokens(self, pending: PendingTokens) -> None:
        """Token ids of rows whose last token the unresolved step sampled, from its device
        tensor into the static input buffer (after the staged ids were copied there)."""
        sampled, source = pending
        rows = np.flatnonzero(source >= 0)
        count = len(rows)
        every_row = count == len(source)  # steady decode: rows are 0..count-1
        stage, device = self._stage_source, self._buf_source
        stage.numpy()[1, :count] = source[rows]
        device[1, :count].copy_(stage[1, :count], non_blocking=True)  # contiguous rows
        tokens = sampled.index_select(0, device[1, :count])
        if every_row:
            self.buf_ints[0, :count].copy_(tokens)
            return
        stage.numpy()[0, :count] = rows
        device[0, :count].copy_(stage[0, :count], non_blocking=True)
        self.buf_ints[0].index_copy_(0, device[0, :count], tokens)
