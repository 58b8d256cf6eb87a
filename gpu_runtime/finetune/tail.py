"""The end of every quantum, shared by :class:`~gpu_runtime.finetune.trainer.LoraTrainer`'s
eager, graphed and layer-sliced paths: commit the data position, accumulate the micro-batch's
loss into its optimizer batch, and at the batch's end clip, step AdamW and zero the gradients;
then hand back a :class:`PendingQuantum` whose ``result()`` reads loss and grad norm (the
quantum's one host sync), records the step and writes a due checkpoint (or, with a validation
file, hands it to the validation quanta that follow: ``LoraTrainer._checkpoint_due``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from gpu_runtime.contract.hparams import FinetuneHyperparameters
from gpu_runtime.finetune.batching import DataStream, MicroBatch, MicroBatchPlan
from gpu_runtime.finetune.graphs import MicroBatchGraphs
from gpu_runtime.finetune.pending import PendingQuantum
from gpu_runtime.finetune.quantum import QuantumResult, StepRecord
from gpu_runtime.finetune.schedule import LrSchedule

if TYPE_CHECKING:
    from gpu_runtime.finetune.trainer import LoraTrainer


class QuantumTailMixin:
    """The trainer's accumulate-and-step tail (the attributes below are the trainer's)."""

    hparams: FinetuneHyperparameters
    device: torch.device
    stream: DataStream
    schedule: LrSchedule
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    graphs: MicroBatchGraphs | None
    step: int
    history: list[StepRecord]
    checkpoint_root: Path | None
    base_model_name_or_path: str | None
    _batch_loss_sum: torch.Tensor
    _batch_correct: torch.Tensor
    _batch_tokens: int
    recompute_micro_batches: int

    def _peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def _launch_tail(
        self,
        plan: MicroBatchPlan,
        batch: MicroBatch,
        loss_sum: torch.Tensor,
        start: float,
        layer_passes: int,
        graph: str = "off",
        graph_fallback: str | None = None,
        launch_s: float | None = None,
        graph_peak_bytes: int | None = None,
        events: tuple[Any, Any] | None = None,
        recompute: bool = False,
    ) -> PendingQuantum:
        """Commit the data position, accumulate, launch the optimizer step at a batch's end;
        the returned quantum's ``result()`` reads loss and grad norm and reports (its host
        sync; synchronous quanta call it at once).

        ``graph_peak_bytes``: what a replayed graph's work needs (its pool is not allocated anew
        on replay, so the allocator's peak alone would not show it); where the allocator keeps
        no figure (CPU), the peak reported."""
        self.stream.commit(plan)
        self._batch_loss_sum += loss_sum.detach()
        self._batch_tokens += batch.num_tokens
        self.recompute_micro_batches += int(recompute)
        batch_tokens = self._batch_tokens
        learning_rate = None
        to_read = [loss_sum.detach()]
        if plan.completes_batch:
            learning_rate = self.schedule.rate(self.step)
            to_read += [
                self._optimizer_step(learning_rate),
                self._batch_loss_sum.clone(),
                self._batch_correct.clone(),
            ]
            self._batch_loss_sum.zero_()  # on this stream, after the clone
            self._batch_correct.zero_()
            self._batch_tokens = 0
        values = torch.stack(to_read)
        if events is not None:
            events[1].record()
        host_s = time.perf_counter() - start
        step, position, finished = self.step, self.stream.position, self.stream.finished
        every = self.hparams.checkpoint_every_steps
        due = plan.completes_batch and (finished or (every > 0 and step % every == 0))

        def read(values: list[float], gpu_ms: float | None) -> QuantumResult:
            grad_norm = batch_loss = None
            if plan.completes_batch:
                grad_norm, batch_loss = values[1], values[2] / plan.batch_loss_tokens
                # a DPO step has no token targets: its accuracy is the preference metrics'
                accuracy = (
                    None
                    if cast("LoraTrainer", self).trains_preferences
                    else values[3] / max(1, plan.batch_loss_tokens)
                )
                assert learning_rate is not None
                self.history.append(
                    StepRecord(step, batch_loss, learning_rate, grad_norm, batch_tokens, accuracy)
                )
            peak = self._peak()
            if graph_peak_bytes is not None:  # no allocator figure (CPU): the graph's own
                peak = graph_peak_bytes if peak is None else max(peak, graph_peak_bytes)
            written = None
            if due:
                written = cast("LoraTrainer", self)._checkpoint_due(final=finished)
            return QuantumResult(
                examples=len(plan.example_indices),
                tokens=batch.num_tokens,
                padded_tokens=batch.padded_tokens,
                loss_tokens=batch.num_loss_tokens,
                loss=values[0] / max(1, batch.num_loss_tokens),
                optimizer_step=plan.completes_batch,
                step=step,
                batch_loss=batch_loss,
                learning_rate=learning_rate,
                grad_norm=grad_norm,
                wall_s=time.perf_counter() - start,
                peak_memory_bytes=peak,
                position=position,
                finished=finished and not cast("LoraTrainer", self).evaluating,
                checkpoint=written,
                layer_passes=layer_passes,
                graph=graph,
                graph_fallback=graph_fallback,
                launch_s=launch_s,
                host_s=host_s,
                gpu_ms=gpu_ms,
                recompute=recompute,
            )

        return PendingQuantum(read, values, events)

    def _optimizer_step(self, learning_rate: float) -> torch.Tensor:
        """Clip, step, zero; returns the pre-clip gradient norm (on device, unsynced)."""
        max_norm = self.hparams.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else 1e30)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        # captured graphs add into the .grad tensors they saw: zero those in place
        self.optimizer.zero_grad(set_to_none=self.graphs is None)
        self.step += 1
        return norm.float()
