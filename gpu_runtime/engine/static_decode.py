"""The runner's decode fast path: fixed-shape buffers padded to a batch bucket, the decode step
over them (fused CUDA kernels, Triton attention, or torch attention on CPU), its CUDA graphs per
(bucket, partition), and the LoRA variant of each.

`StaticDecodeMixin` is part of `ModelRunner` (split out by role); it reads the runner's model,
KV cache, request rows and config, and owns the staging and static buffers.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.torch_paged import TorchPagedAttention, torch_compute_dtype
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.cuda_graphs import DecodeGraphs, freeze_long_lived, gc_paused_for_capture
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.engine.lora import LoraForward, LoraRuntime
from gpu_runtime.engine.runner_types import (
    _PADDING_ID,
    PendingTokens,
    StepHandle,
    _RequestState,
    blas_library,
    gemm_sm_target,
)
from gpu_runtime.model.llama import CausalLM

if TYPE_CHECKING:
    from gpu_runtime.engine.fast_decode import FusedDecodeForward as FusedDecodeForwardType
    from gpu_runtime.engine.mixed_graphs import MixedStepGraphs


class StaticDecodeMixin:
    """Decode-only steps over static buffers (what CUDA graphs replay); see the module doc."""

    # set by ModelRunner.__init__
    config: EngineConfig
    model: CausalLM
    lora: LoraRuntime | None
    device: torch.device
    kv_cache: PagedKVCache
    block_size: int
    use_triton: bool
    mixed_attention: bool
    num_static_decode_steps: int
    num_lora_graph_steps: int
    _buckets: tuple[int, ...]
    _num_sms: int
    _table_np: np.ndarray
    _graphs: DecodeGraphs | None
    _lora_graphs: DecodeGraphs | None
    _fused: FusedDecodeForwardType | None
    _mixed: MixedStepGraphs | None
    _blas: str | None
    _last_launched: StepHandle | None

    def _init_decode_buffers(self, pin: bool) -> None:
        size = self._buckets[-1]
        dev = self.device
        width = self.config.max_blocks_per_seq
        # rows: token id, position, slot block, slot offset, LoRA slot (-1: base)
        # Two sets of pinned staging buffers, used in turn by successive steps: a step may be
        # launched before the previous one's copies ran (`ModelRunner.launch`), and must not
        # overwrite them. Rows of `ints`: token id, position, slot block, slot offset, LoRA
        # slot; `source`: rows taking their token from the device, and where from.
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
        self._buf_ints = torch.zeros(5, size, dtype=torch.int64, device=dev)
        self._buf_ints[2].fill_(self.kv_cache.pad_block)
        self._buf_ints[4].fill_(-1)
        self._buf_seq_lens = torch.zeros(size, dtype=torch.int32, device=dev)
        self._buf_table = torch.zeros(size, width, dtype=torch.int32, device=dev)
        if self.use_triton and self.config.fused_decode_kernels:
            from gpu_runtime.engine.fast_decode import FusedDecodeForward

            groups = self.lora.decode_groups() if self.lora is not None else None
            self._fused = FusedDecodeForward(
                self.model,
                self.kv_cache,
                self.config.max_model_len,
                groups,
                fuse_lora_expand=self.config.lora_expand_in_kernels,
                programmatic_launch_rows=self.config.decode_programmatic_launch_rows,
            )
            if self.config.mixed_cuda_graphs and self.mixed_attention:
                from gpu_runtime.engine.mixed_graphs import MixedStepGraphs

                self._mixed = MixedStepGraphs(
                    self._fused,
                    self.kv_cache,
                    self.config.mixed_graph_token_sizes(),
                    self.config.max_num_seqs + 1,
                    pin,
                )

    def _use_staging_set(self) -> None:
        """Switch to the other set of pinned staging buffers (and their numpy views)."""
        self._staging_parity ^= 1
        ints, seq_lens, table, source = self._staging[self._staging_parity]
        self._stage_ints, self._stage_seq_lens, self._stage_table = ints, seq_lens, table
        self._stage_source = source
        # numpy views of the pinned staging buffers (shared memory) for vectorised filling
        self._stage_ints_np = ints.numpy()
        self._stage_seq_lens_np = seq_lens.numpy()
        self._stage_table_np = table.numpy()

    @property
    def max_bucket(self) -> int:
        """Largest decode batch the bucketed path takes."""
        return self._buckets[-1]

    @property
    def fused_lora_decode(self) -> bool:
        """Decode steps with adapters run the fused (graph-captured) LoRA step."""
        return self._fused is not None and self._fused.lora_groups is not None

    def decode_forward_lora(self, bucket: int) -> torch.Tensor:
        """Logits `[bucket, vocab]` of the fused decode step plus each row's LoRA terms (the
        rows' slots are read from the static buffer; graph body)."""
        assert self._fused is not None
        from gpu_runtime.engine.attention.triton_decode import choose_num_splits

        metadata = AttentionMetadata(
            slot_blocks=self._buf_ints[2, :bucket],
            slot_offsets=self._buf_ints[3, :bucket],
            seq_lens=self._buf_seq_lens[:bucket],
            block_tables=self._buf_table[:bucket],
        )
        splits = choose_num_splits(bucket, self.model.config.num_key_value_heads, self._num_sms)
        ids, positions = self._buf_ints[0, :bucket], self._buf_ints[1, :bucket]
        return self._fused(ids, positions, metadata, splits, self._buf_ints[4, :bucket])

    def decode_forward(self, bucket: int, forward: LoraForward | None = None) -> torch.Tensor:
        """Logits `[bucket, vocab]` of a decode step over the static buffers (graph body).

        `forward` replaces the model's forward (the LoRA forward; never the fused kernels)."""
        model_forward = forward if forward is not None else self.model
        metadata = AttentionMetadata(
            slot_blocks=self._buf_ints[2, :bucket],
            slot_offsets=self._buf_ints[3, :bucket],
            seq_lens=self._buf_seq_lens[:bucket],
            block_tables=self._buf_table[:bucket],
        )
        if not self.use_triton:  # same buffers, torch attention (CPU coverage of the staging)
            metadata.query_lens_host = [1] * bucket
            metadata.seq_lens_host = self._stage_seq_lens_np[:bucket].tolist()
            dtype = torch_compute_dtype(self.device)
            reference = TorchPagedAttention(self.kv_cache, metadata, dtype)
            hidden = model_forward(
                self._buf_ints[0, :bucket], self._buf_ints[1, :bucket], reference
            )
            return self.model.compute_logits(hidden)
        from gpu_runtime.engine.attention.triton_decode import (
            TritonDecodeAttention,
            choose_num_splits,
        )

        splits = choose_num_splits(bucket, self.model.config.num_key_value_heads, self._num_sms)
        if self._fused is not None and forward is None:
            return self._fused(
                self._buf_ints[0, :bucket], self._buf_ints[1, :bucket], metadata, splits
            )
        attention = TritonDecodeAttention(self.kv_cache, metadata, splits)
        hidden = model_forward(self._buf_ints[0, :bucket], self._buf_ints[1, :bucket], attention)
        return self.model.compute_logits(hidden)

    def capture_cuda_graphs(
        self,
        batch_sizes: tuple[int, ...] | None = None,
        partition: Hashable = None,
        stream: torch.cuda.Stream | None = None,
        sm_count: int | None = None,
    ) -> list[int]:
        """Capture the decode step for each bucket (largest first); returns those captured.

        `partition`/`stream` key and place the capture for one SM partition; `sm_count`, the
        SMs that partition's kernels may use, lets its GEMMs plan for them
        (`EngineConfig.partition_gemm_sm_target`). With a LoRA runtime on the fused path, the
        LoRA step is captured too (same buckets, same pool).
        """
        if not (self.use_triton and self.config.use_cuda_graphs):
            return []
        if self._graphs is None:
            self._graphs = DecodeGraphs(self.decode_forward)
            if self.fused_lora_decode:
                self._lora_graphs = DecodeGraphs(self.decode_forward_lora, self._graphs)
        sizes = sorted(batch_sizes or self._buckets, reverse=True)
        for size in sizes:
            if size not in self._buckets:
                raise ValueError(f"batch size {size} is not a bucket of {self._buckets}")
        target = sm_count if self.config.partition_gemm_sm_target else None
        with (
            blas_library(self._blas),
            gemm_sm_target(target, self._num_sms),
            gc_paused_for_capture(),  # one collection for all
        ):
            for size in sizes:
                self._graphs.capture(size, partition, stream)
                if self._lora_graphs is not None:
                    self._lora_graphs.capture(size, partition, stream)
            if self._mixed is not None:
                for tokens in reversed(self._mixed.buckets):
                    self._mixed.capture(tokens, partition, stream)
        if self.config.gc_freeze_after_capture:
            freeze_long_lived()  # full collections stop walking the model and engine
        return sizes

    def _decode_logits(
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
        bucket = next(b for b in self._buckets if b >= batch)
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
        seq_lens = self._stage_seq_lens_np
        seq_lens[:batch] = pos + 1
        seq_lens[batch:bucket] = 0  # padded slots attend to nothing
        np.take(self._table_np, rows, axis=0, out=self._stage_table_np[:batch])
        self._buf_ints[:, :bucket].copy_(self._stage_ints[:, :bucket], non_blocking=True)
        self._buf_seq_lens[:bucket].copy_(self._stage_seq_lens[:bucket], non_blocking=True)
        self._buf_table[:bucket].copy_(self._stage_table[:bucket], non_blocking=True)
        if pending is not None:  # last tokens still on the device: gather them there
            self._gather_pending_tokens(pending)
        self.num_static_decode_steps += 1
        graphs = self._graphs
        lora = self.lora
        lora_graphs = self._lora_graphs
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

    def _pending_inputs(self, states: list[_RequestState]) -> PendingTokens | None:
        """Rows whose last token is still on the device: the unresolved step's sampled tensor
        and, per row, the index into it (-1: the token is on the host)."""
        last = self._last_launched
        if last is None or last.resolved or last.token_ids is None:
            return None
        step = last.step
        source = np.fromiter(
            (s.pending_index if s.pending_step == step else -1 for s in states),
            np.int64,
            len(states),
        )
        if (source < 0).all():
            return None
        return last.token_ids, source

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
            self._buf_ints[0, :count].copy_(tokens)
            return
        stage.numpy()[0, :count] = rows
        device[0, :count].copy_(stage[0, :count], non_blocking=True)
        self._buf_ints[0].index_copy_(0, device[0, :count], tokens)
