"""The end of every quantum of a trainer, whatever ran its micro-batch (eagerly, as a CUDA graph
or in layer slices): :class:`OptimizerTail`.

It commits the data position, adds the micro-batch's summed loss into its optimizer batch and,
at the batch's end, clips the gradients, steps AdamW at the schedule's rate and zeroes the
gradients; then it hands back a :class:`~gpu_runtime.finetune.pending.PendingQuantum` whose
``result()`` reads loss and grad norm (the quantum's one host sync), records the optimizer step
in :attr:`OptimizerTail.history` and, when the step made a checkpoint due (every
``checkpoint_every_steps`` and at the end), asks the trainer to take it
(:class:`CheckpointHook`). The tail owns the optimizer step count, the loss history and the
batch accumulators; nothing else writes them. On a tensor-parallel rank its ``gradients``
(:class:`~gpu_runtime.finetune.sharded_gradients.ShardedGradients`) sum the replicated
gradients over the ranks and clip by the whole adapter's norm before AdamW steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from gpu_runtime.contract.hparams import FinetuneHyperparameters
from gpu_runtime.finetune.batching import DataStream, MicroBatch, MicroBatchPlan
from gpu_runtime.finetune.pending import PendingQuantum
from gpu_runtime.finetune.quantum import QuantumResult, StepRecord, peak_allocated
from gpu_runtime.finetune.schedule import LrSchedule
from gpu_runtime.finetune.sharded_gradients import ShardedGradients


class CheckpointHook(Protocol):
    """What a quantum's result asks of its trainer when read, after a step made a checkpoint
    due."""

    def checkpoint_due(self, *, final: bool) -> Path | None:
        """Take the due checkpoint: the path written now, or None (not written now: validation
        passes run first, or there is no checkpoint root)."""
        ...

    @property
    def evaluating(self) -> bool:
        """Whether the next quanta run a due checkpoint's validation passes."""
        ...


class OptimizerTail:
    """Accumulate micro-batches into their optimizer batch, step at its end, report the quantum
    (see the module docstring)."""

    def __init__(
        self,
        hparams: FinetuneHyperparameters,
        stream: DataStream,
        params: Sequence[torch.nn.Parameter],
        device: torch.device,
        *,
        token_accuracy: bool,
        gradients: ShardedGradients | None = None,
    ) -> None:
        """AdamW over ``params`` (fused on CUDA) with ``hparams``' settings, its rate from the
        schedule over ``stream``'s optimizer steps; ``token_accuracy``: the forward counts argmax
        hits into :attr:`batch_correct` (a DPO step has no token targets: its accuracy is the
        preference metrics', none here); ``gradients``: a tensor-parallel rank's reduction and
        global-norm clipping (None at one GPU)."""
        self.hparams = hparams
        self.gradients = gradients
        self.stream = stream
        self.params = list(params)
        self.device = device
        self.token_accuracy = token_accuracy
        self.schedule = LrSchedule.from_ratio(
            hparams.learning_rate,
            stream.total_optimizer_steps,
            hparams.warmup_ratio,
            hparams.lr_schedule,
        )
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=self.schedule.rate(0),
            betas=hparams.adam_betas,
            eps=hparams.adam_eps,
            weight_decay=hparams.weight_decay,
            fused=device.type == "cuda",
        )
        self.step = 0
        """Optimizer steps done."""
        self.history: list[StepRecord] = []
        self.recompute_micro_batches = 0
        """Micro-batches completed with recomputation (whole or layer-sliced)."""
        self.batch_loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.batch_correct = torch.zeros((), dtype=torch.float32, device=self.device)
        """Argmax hits of the optimizer batch in progress (token accuracy; the loss adds in
        place, so captured graphs add into this very tensor)."""
        self.batch_tokens = 0
        self.keep_grad_tensors = False
        """Zero the ``.grad`` tensors in place rather than dropping them (set while CUDA graphs
        are in use: captured backwards add into the tensors they saw)."""

    def restore(self, step: int, history: Sequence[dict[str, float]]) -> None:
        """Set the step count and loss history (checkpoint loading; between batches only)."""
        self.step = step
        self.history = [
            StepRecord(
                step=int(h["step"]),
                loss=float(h["loss"]),
                learning_rate=float(h["learning_rate"]),
                grad_norm=float(h["grad_norm"]),
                tokens=int(h["tokens"]),
                accuracy=None if h.get("accuracy") is None else float(h["accuracy"]),
            )
            for h in history
        ]

    def launch(
        self,
        plan: MicroBatchPlan,
        batch: MicroBatch,
        loss_sum: torch.Tensor,
        start: float,
        checkpoints: CheckpointHook,
        *,
        layer_passes: int = 0,
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

        ``start``: the quantum's start (``time.perf_counter()``); ``graph_peak_bytes``: what a
        replayed graph's work needs (its pool is not allocated anew on replay, so the
        allocator's peak alone would not show it); where the allocator keeps no figure (CPU),
        the peak reported."""
        self.stream.commit(plan)
        self.batch_loss_sum += loss_sum.detach()
        self.batch_tokens += batch.num_tokens
        self.recompute_micro_batches += int(recompute)
        batch_tokens = self.batch_tokens
        learning_rate = None
        to_read = [loss_sum.detach()]
        if plan.completes_batch:
            learning_rate = self.schedule.rate(self.step)
            to_read += [
                self.optimizer_step(learning_rate),
                self.batch_loss_sum.clone(),
                self.batch_correct.clone(),
            ]
            self.batch_loss_sum.zero_()  # on this stream, after the clone
            self.batch_correct.zero_()
            self.batch_tokens = 0
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
                accuracy = (
                    values[3] / max(1, plan.batch_loss_tokens) if self.token_accuracy else None
                )
                assert learning_rate is not None
                self.history.append(
                    StepRecord(step, batch_loss, learning_rate, grad_norm, batch_tokens, accuracy)
                )
            peak = peak_allocated(self.device)
            if graph_peak_bytes is not None:  # no allocator figure (CPU): the graph's own
                peak = graph_peak_bytes if peak is None else max(peak, graph_peak_bytes)
            written = None
            if due:
                written = checkpoints.checkpoint_due(final=finished)
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
                finished=finished and not checkpoints.evaluating,
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

    def optimizer_step(self, learning_rate: float) -> torch.Tensor:
        """Clip, step, zero; returns the pre-clip gradient norm (on device, unsynced)."""
        max_norm = self.hparams.max_grad_norm
        bound = max_norm if max_norm > 0 else 1e30
        if self.gradients is not None:
            norm = self.gradients.clip_(self.params, bound)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, bound)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grad_tensors)
        self.step += 1
        return norm.float()
