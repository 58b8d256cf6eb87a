"""Whole micro-batches through CUDA graphs: :class:`GraphedQuanta`.

A graphed micro-batch is planned with its length padded to the graphs' sequence bucket, collated
on the host, handed to :class:`~gpu_runtime.finetune.graphs.MicroBatchGraphs` (replayed,
captured, or run eagerly when the capture policy says so; keyed by its shape, stream and
recomputation mode) on the graphs' stream, and ended in the trainer's
:class:`~gpu_runtime.finetune.tail.OptimizerTail`. :meth:`GraphedQuanta.would_replay` answers,
without changing anything, whether the next such micro-batch would replay a captured graph on
a given stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from gpu_runtime.finetune.batching import DataStream, MicroBatch, MicroBatchPlan, collate
from gpu_runtime.finetune.graphs import GraphRun, MicroBatchGraphs
from gpu_runtime.finetune.pending import PendingQuantum
from gpu_runtime.finetune.tail import CheckpointHook, OptimizerTail


class GraphedQuanta:
    """A trainer's whole micro-batches through its CUDA graphs (see the module docstring)."""

    def __init__(
        self,
        graphs: MicroBatchGraphs,
        stream: DataStream,
        pad_token_id: int,
        tail: OptimizerTail,
    ) -> None:
        self.graphs = graphs
        self.stream = stream
        self.pad_token_id = pad_token_id
        self.tail = tail

    def _next_micro_batch(
        self, max_examples: int | None, max_tokens: int | None
    ) -> tuple[MicroBatchPlan, MicroBatch]:
        """The next micro-batch's plan and its host tensors, padded to its sequence bucket."""
        bucket = self.graphs.padded_length
        plan = self.stream.plan(max_examples, max_tokens, padded_length=bucket)
        examples = [self.stream.examples[i] for i in plan.example_indices]
        longest = max(e.num_tokens for e in examples)
        return plan, collate(examples, self.pad_token_id, seq_len=bucket(longest))

    def would_replay(
        self, max_tokens: int | None, streams: Iterable[int], recompute: bool
    ) -> dict[int, bool]:
        """Per CUDA stream handle: whether the next micro-batch of at most ``max_tokens``
        tokens would replay a captured graph there (planned and collated on the host once for
        every stream; nothing changes)."""
        _, batch = self._next_micro_batch(None, max_tokens)
        return {stream: self.graphs.would_replay(batch, stream, recompute) for stream in streams}

    def launch(
        self,
        max_examples: int | None,
        max_tokens: int | None,
        recompute: bool,
        start: float,
        allocated: int,
        timed: bool,
        checkpoints: CheckpointHook,
    ) -> PendingQuantum:
        """The next whole micro-batch through the graphs, launched on their stream; ``start``
        and ``allocated``: the quantum's start time and the bytes allocated then; ``timed``:
        bracket its work with CUDA events (``QuantumResult.gpu_ms``)."""
        with self.graphs.on_stream():
            events = None
            if timed:
                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            plan, batch = self._next_micro_batch(max_examples, max_tokens)
            launch = time.perf_counter()
            run: GraphRun = self.graphs.run(batch, plan.batch_loss_tokens, recompute)
            launch_s = time.perf_counter() - launch
            graph_peak = None if run.extra_bytes is None else allocated + run.extra_bytes
            return self.tail.launch(
                plan,
                batch,
                run.loss_sum,
                start,
                checkpoints,
                graph=run.mode,
                graph_fallback=run.fallback,
                launch_s=launch_s,
                graph_peak_bytes=graph_peak,
                events=events,
                recompute=recompute,
            )
