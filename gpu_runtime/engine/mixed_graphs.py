"""CUDA graphs for steps that carry prefill chunks ("mixed" steps), piecewise per token bucket.

A mixed step's attention depends on host lists (which rows are chunks, their lengths), so it
stays eager (`MixedPagedAttention.attend`). Everything between two attentions (the o
projection, the MLP, the next layer's norms, its q|k|v projection and RoPE + cache write) has
fixed shapes once the step's tokens are padded to a bucket, and is replayed from one graph per
layer boundary: `num_layers + 1` graphs per (token bucket, partition). Eagerly, the same step
launches about ten kernels per layer from Python and is host-bound whatever its chunk sizes.

The graph bodies are the model's own walk (`decoder.post_attention` of one layer, then
`decoder.pre_attention` of the next and `FusedDecodeOps.rope_and_cache_write`; the last body
`DecoderStack.final_norm`) over the fused step's base kernels (`FusedDecodeOps` without
adapter slots, programmatic launch off).

Padding tokens have id 0 and position 0 and write their K/V into the runner's padding block;
they are never attended to (attention runs over the real tokens only) nor sampled. The graphs
read their inputs from static buffers staged per step and hand over the residual stream, the
rotated queries and the attention output through static buffers as well.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from gpu_runtime.engine.attention.mixed import MixedPagedAttention
from gpu_runtime.engine.cuda_graphs import gc_paused_for_capture
from gpu_runtime.engine.fast_decode import FusedDecodeForward, FusedDecodeOps
from gpu_runtime.engine.flat_batch import FlatBatch
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.model.decoder import post_attention, pre_attention


class MixedStepGraphs:
    """Piecewise graphs of the fused step (over its KV cache) for steps of up to the largest
    bucket's tokens."""

    def __init__(
        self,
        fused: FusedDecodeForward,
        token_buckets: tuple[int, ...],
        max_rows: int,
        pin: bool = True,
    ) -> None:
        """`token_buckets`: increasing token counts a step is padded to; `max_rows`: most
        sampled rows in a step (sequences per step)."""
        self.fused = fused
        self.cache: PagedKVCache = fused.cache
        self.buckets = token_buckets
        self.max_rows = max_rows
        model = fused.model
        self.num_layers = len(model.decoder_layers)
        weight = model.model.embed_tokens.weight
        dev, dtype = weight.device, weight.dtype
        size = token_buckets[-1]
        hidden = model.config.hidden_size
        heads, dim = fused.num_heads, fused.head_dim
        # rows: token id, position, cache block, offset in block
        self._stage = torch.zeros(4, size, dtype=torch.int64, pin_memory=pin)
        self._stage_np = self._stage.numpy()
        self._inputs = torch.zeros(4, size, dtype=torch.int64, device=dev)
        self._rows_stage = torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin)
        self._rows_np = self._rows_stage.numpy()
        self._rows = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self._q = torch.zeros(size, heads, dim, dtype=dtype, device=dev)  # rotated queries
        self._attn = torch.zeros(size, heads * dim, dtype=dtype, device=dev)  # attention out
        self._residual = torch.zeros(size, hidden, dtype=dtype, device=dev)
        vocab = model.config.vocab_size
        # every bucket's graphs write their logits here (one [rows, vocab] buffer in all)
        self._logits_out = torch.zeros(max_rows, vocab, dtype=dtype, device=dev)
        self._graphs: dict[tuple[int, Hashable], list[torch.cuda.CUDAGraph]] = {}
        self._pool: Any = None

    # ---- shapes -----------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int | None:
        """Smallest bucket holding `num_tokens`, None when the step is larger than all."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def rows_for(self, bucket: int) -> int:
        """Sampled rows a bucket's graphs compute logits for."""
        return min(bucket, self.max_rows)

    def has(self, bucket: int, partition: Hashable = None) -> bool:
        """True when that bucket's graphs are captured for that partition."""
        return (bucket, partition) in self._graphs

    # ---- graph bodies -----------------------------------------------------------------------
    def segment(self, index: int, bucket: int) -> torch.Tensor | None:
        """Graph body `index` (0..num_layers) over `bucket` padded tokens: the end of layer
        `index - 1` after its attention (none for 0: the embedding) and the start of layer
        `index` up to its rotated queries (none for the last: the final norm and the logits
        `[rows_for(bucket), vocab]` of the staged sampled rows, written to one buffer shared by
        all buckets and returned)."""
        fused = self.fused
        model = fused.model
        layers = model.decoder_layers
        ops = FusedDecodeOps(
            fused,
            self._inputs[1, :bucket],
            self._inputs[2, :bucket],
            self._inputs[3, :bucket],
            None,
        )
        residual: torch.Tensor | None
        if index == 0:
            x = model.model.embed_tokens(self._inputs[0, :bucket])  # [T, hidden]
            residual = None
        else:
            x, residual = post_attention(
                ops, index - 1, layers[index - 1], self._attn[:bucket], self._residual[:bucket]
            )
        if index == self.num_layers:
            h = model.model.final_norm(ops, x, residual)
            rows = self.rows_for(bucket)
            picked = h.index_select(0, self._rows[:rows])
            head = model.lm_head
            out = self._logits_out[:rows]
            if head.bias is None:
                torch.mm(picked, head.weight.t(), out=out)
            else:
                out.copy_(model.compute_logits(picked))
            return out
        qkv, residual = pre_attention(ops, index, layers[index], x, residual)
        self._q[:bucket].copy_(ops.rope_and_cache_write(index, qkv))  # [T, H, D]
        self._residual[:bucket].copy_(residual)
        return None

    # ---- per step ---------------------------------------------------------------------------
    def stage(self, flat: FlatBatch, bucket: int) -> None:
        """Copy the step's tokens (padded to `bucket`) and sampled rows to the device."""
        n = len(flat.tokens)
        stage = self._stage_np
        stage[0, :n] = flat.tokens
        stage[1, :n] = flat.positions
        stage[2, :n] = flat.blocks
        stage[3, :n] = flat.offsets
        stage[:, n:bucket] = 0
        stage[2, n:bucket] = self.cache.pad_block
        rows = self.rows_for(bucket)
        sampled = len(flat.sample_index)
        self._rows_np[:sampled] = np.asarray(flat.sample_index, dtype=np.int64)
        self._rows_np[sampled:rows] = 0
        self._inputs[:, :bucket].copy_(self._stage[:, :bucket], non_blocking=True)
        self._rows[:rows].copy_(self._rows_stage[:rows], non_blocking=True)

    def run(
        self,
        flat: FlatBatch,
        attention: MixedPagedAttention,
        bucket: int,
        partition: Hashable = None,
        replay: bool = True,
    ) -> torch.Tensor:
        """Logits `[sampled rows, vocab]` of the step: stage, then graph 0, and per layer the
        eager attention over the real tokens followed by the next graph. `replay=False` runs
        the graph bodies eagerly instead (same kernels; CPU checks of the decomposition)."""
        self.stage(flat, bucket)
        n = len(flat.tokens)
        graphs = self._graphs.get((bucket, partition)) if replay else None
        if replay and graphs is None:
            raise KeyError(f"no mixed-step graphs for bucket {bucket}, partition {partition!r}")
        logits: torch.Tensor | None = None
        for index in range(self.num_layers + 1):
            if index > 0:
                attention.attend(index - 1, self._q[:n], self._attn[:n].view(self._q[:n].shape))
            if graphs is not None:
                graphs[index].replay()
            else:
                logits = self.segment(index, bucket)
        if graphs is not None:
            logits = self._logits_out
        assert logits is not None
        return logits[: len(flat.sample_index)]

    @torch.no_grad()
    def capture(
        self, bucket: int, partition: Hashable = None, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Warm up (compiles kernels) and capture the bucket's `num_layers + 1` graphs on
        `stream`, over padding tokens only (their K/V go to the padding block). The garbage
        collector is paused meanwhile (`cuda_graphs.gc_paused_for_capture`)."""
        self._inputs[:, :bucket].zero_()
        self._inputs[2, :bucket].fill_(self.cache.pad_block)
        self._rows.zero_()
        stream = stream or torch.cuda.Stream()
        current = torch.cuda.current_stream()
        with gc_paused_for_capture():
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for index in range(self.num_layers + 1):
                    self.segment(index, bucket)
            current.wait_stream(stream)
            graphs = []
            for index in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    self.segment(index, bucket)
                if self._pool is None:
                    self._pool = graph.pool()
                graphs.append(graph)
        self._graphs[(bucket, partition)] = graphs
