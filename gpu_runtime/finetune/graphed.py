"""The launches of whole micro-batches through CUDA graphs, for
:class:`~gpu_runtime.finetune.trainer.LoraTrainer`: :meth:`GraphedQuantaMixin.start_quantum`
(launch without waiting for the GPU), :meth:`GraphedQuantaMixin.replays_next` (would the next
micro-batch replay a captured graph) and the graphed micro-batch both ``start_quantum`` and
``step_quantum`` run (padded to its sequence bucket, keyed by its shape, stream and
recomputation mode; :mod:`gpu_runtime.finetune.graphs`)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from gpu_runtime.finetune.batching import DataStream, collate
from gpu_runtime.finetune.graphs import GraphRun, MicroBatchGraphs
from gpu_runtime.finetune.pending import PendingQuantum
from gpu_runtime.finetune.quantum import QuantumResult
from gpu_runtime.finetune.tail import QuantumTailMixin


class GraphedQuantaMixin(QuantumTailMixin):
    """The trainer's graphed launches (the attributes and methods below are the trainer's;
    every launch ends in the shared tail, ``QuantumTailMixin._launch_tail``)."""

    graphs: MicroBatchGraphs | None
    device: torch.device
    stream: DataStream
    pad_token_id: int
    recompute: bool
    _pending: object | None
    _unread: PendingQuantum | None

    if TYPE_CHECKING:  # the trainer's (LoraTrainer)

        @property
        def finished(self) -> bool: ...

        @property
        def evaluating(self) -> bool: ...

        def step_quantum(
            self,
            max_tokens: int | None = None,
            max_examples: int | None = None,
            max_layers: int | None = None,
            recompute: bool | None = None,
        ) -> QuantumResult: ...

        def _begin_quantum(self) -> tuple[float, int]: ...

    def _recompute(self, recompute: bool | None) -> bool:
        return self.recompute if recompute is None else recompute

    def start_quantum(
        self,
        max_tokens: int | None = None,
        max_examples: int | None = None,
        recompute: bool | None = None,
    ) -> PendingQuantum:
        """A whole micro-batch like ``step_quantum``, launched without waiting for the GPU.

        With CUDA graphs (and no layer-sliced micro-batch in progress) this only issues the
        graph replay and the optimizer step on the current stream and returns; the caller polls
        :meth:`PendingQuantum.done` and reads :meth:`PendingQuantum.result` (its ``gpu_ms`` is
        the quantum's time on the stream). Anything else runs to its end here and comes back
        done. No other quantum starts until that result has been read (RuntimeError)."""
        if (
            self.graphs is None
            or self._pending is not None
            or self.device.type != "cuda"
            or self.evaluating
        ):
            return PendingQuantum.finished(
                self.step_quantum(max_tokens, max_examples, recompute=recompute)
            )
        start, allocated = self._begin_quantum()
        with self.graphs.on_stream():
            launched = self._graphed_micro_batch(
                max_examples, max_tokens, self._recompute(recompute), start, allocated, True
            )
        if not launched.done():
            self._unread = launched
        return launched

    def replays_next(
        self, max_tokens: int | None, streams: Iterable[int], recompute: bool | None = None
    ) -> dict[int, bool] | None:
        """Per CUDA stream handle in ``streams``: whether the next whole micro-batch of at most
        ``max_tokens`` tokens, launched from this thread on that stream, would replay a
        captured graph (True) or first warm up or be captured, a one-off stall of the launching
        thread of ~0.1-0.3 s on an H200 (False); None: the job does not run graphs. Nothing
        changes (the micro-batch is planned and collated on the host once for every stream)."""
        graphs = self.graphs
        if graphs is None or graphs.disabled is not None or self.finished or self.evaluating:
            return None
        bucket = graphs.padded_length
        plan = self.stream.plan(None, max_tokens, padded_length=bucket)
        examples = [self.stream.examples[i] for i in plan.example_indices]
        longest = max(e.num_tokens for e in examples)
        batch = collate(examples, self.pad_token_id, seq_len=bucket(longest))
        mode = self._recompute(recompute)
        return {stream: graphs.would_replay(batch, stream, mode) for stream in streams}

    def _graphed_micro_batch(
        self,
        max_examples: int | None,
        max_tokens: int | None,
        recompute: bool,
        start: float,
        allocated: int,
        timed: bool,
    ) -> PendingQuantum:
        """A whole micro-batch through :attr:`graphs` (padded to its sequence bucket), launched;
        ``timed``: bracket its work with CUDA events (``QuantumResult.gpu_ms``)."""
        assert self.graphs is not None
        events = None
        if timed:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        bucket = self.graphs.padded_length
        plan = self.stream.plan(max_examples, max_tokens, padded_length=bucket)
        examples = [self.stream.examples[i] for i in plan.example_indices]
        longest = max(e.num_tokens for e in examples)
        batch = collate(examples, self.pad_token_id, seq_len=bucket(longest))  # host tensors
        launch = time.perf_counter()
        run: GraphRun = self.graphs.run(batch, plan.batch_loss_tokens, recompute)
        launch_s = time.perf_counter() - launch
        graph_peak = None if run.extra_bytes is None else allocated + run.extra_bytes
        return self._launch_tail(
            plan,
            batch,
            run.loss_sum,
            start,
            0,
            graph=run.mode,
            graph_fallback=run.fallback,
            launch_s=launch_s,
            graph_peak_bytes=graph_peak,
            events=events,
            recompute=recompute,
        )
