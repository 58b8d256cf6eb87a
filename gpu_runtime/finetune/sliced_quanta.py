"""Quanta of a few decoder-layer passes: :class:`LayerSlicedQuanta`.

With ``max_layers=k`` a quantum runs ``k`` layer passes (forward or backward) of the micro-batch
in progress (:class:`~gpu_runtime.finetune.sliced.SlicedMicroBatch`), starting one when none is;
the quantum that completes its backward ends in the trainer's
:class:`~gpu_runtime.finetune.tail.OptimizerTail` like a whole micro-batch, with identical
results. Slices run eagerly, with the trainer's generators swapped in; a quantum short of the
micro-batch's end trains no example and syncs the device (its ``wall_s`` is its real duration).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from gpu_runtime.finetune.batching import DataStream, MicroBatch, MicroBatchPlan
from gpu_runtime.finetune.quantum import (
    QuantumResult,
    TrainerRng,
    no_training_result,
    peak_allocated,
    swapped_rng,
)
from gpu_runtime.finetune.sliced import SlicedMicroBatch
from gpu_runtime.finetune.supervised_loss import SupervisedLoss
from gpu_runtime.finetune.tail import CheckpointHook, OptimizerTail


class LayerSlicedQuanta:
    """A trainer's micro-batch in progress, advanced by layer passes (see the module
    docstring)."""

    def __init__(
        self, stream: DataStream, loss: SupervisedLoss, tail: OptimizerTail, rng: TrainerRng
    ) -> None:
        self.stream = stream
        self.loss = loss
        self.tail = tail
        self.rng = rng
        self._in_progress: tuple[MicroBatchPlan, MicroBatch, SlicedMicroBatch] | None = None

    @property
    def in_progress(self) -> bool:
        """Whether a micro-batch has started and not completed its backward."""
        return self._in_progress is not None

    def advance(
        self,
        max_examples: int | None,
        max_tokens: int | None,
        max_layers: int | None,
        recompute: bool,
        start: float,
        checkpoints: CheckpointHook,
        graph: dict[str, Any],
    ) -> QuantumResult:
        """Up to ``max_layers`` layer passes (None: all that remain) of the micro-batch in
        progress, starting one sized by ``max_examples``/``max_tokens`` in mode ``recompute``
        when none is (one in progress keeps its mode); ``start``: the quantum's start time;
        ``graph``: the result's graph fields."""
        if self._in_progress is None:
            loss = self.loss
            plan = self.stream.plan(max_examples, max_tokens, loss.pad_to_multiple)
            batch = loss.prepare([self.stream.examples[i] for i in plan.example_indices])
            sliced = SlicedMicroBatch(
                loss.layer_stack(),
                batch.input_ids,
                batch.positions,
                functools.partial(loss.chunked_loss, batch),
                plan.batch_loss_tokens,
                recompute,
            )
            self._in_progress = (plan, batch, sliced)
        plan, batch, sliced = self._in_progress
        budget = max_layers if max_layers is not None else sliced.total_layer_passes
        with swapped_rng(self.rng), self.loss.autocast():
            passes = sliced.advance(budget)
        device = self.loss.device
        if not sliced.done:
            host_s = time.perf_counter() - start
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return no_training_result(
                step=self.tail.step,
                position=self.stream.position,
                finished=False,
                wall_s=time.perf_counter() - start,
                peak=peak_allocated(device),
                layer_passes=passes,
                micro_batch_done=False,
                host_s=host_s,
                **graph,
            )
        self._in_progress = None
        assert sliced.loss_sum is not None
        tail = self.tail.launch(
            plan,
            batch,
            sliced.loss_sum,
            start,
            checkpoints,
            layer_passes=passes,
            recompute=sliced.checkpointing,
            **graph,
        )
        return tail.result()
