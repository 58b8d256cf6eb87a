"""A trainer's checkpoints and their validation: :class:`Checkpointing`.

When an optimizer step makes a checkpoint due (every ``checkpoint_every_steps`` and at the end),
the trainer hands it here (:meth:`Checkpointing.due`). Without a validation file the
checkpoint's metrics are the step's own and it is written at once (when there is a checkpoint
root). With one, its validation passes (:class:`~gpu_runtime.finetune.validation.
CheckpointEvaluation`: a fixed sample, and every example at the final checkpoint) become the
trainer's next quanta, one micro-batch each (:meth:`Checkpointing.evaluation_step`); the last of
them keeps the metrics and writes the checkpoint, so it holds exactly the state evaluated
(:meth:`Checkpointing.evaluation_quantum` reports such a quantum).
While they run, :attr:`Checkpointing.evaluating` is True and the trainer trains nothing.

It holds the checkpoint root, the validation examples and sample, the evaluator of a validation
micro-batch (a supervised trainer's token loss, a DPO trainer's preference loss) and the latest
checkpoint's metrics. What a checkpoint saves is the trainer's state, passed to each call that
writes one (:class:`~gpu_runtime.finetune.checkpoint.CheckpointedTrainer`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.finetune.checkpoint import CheckpointedTrainer, save_checkpoint
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.quantum import QuantumResult, no_training_result, peak_allocated
from gpu_runtime.finetune.tail import OptimizerTail
from gpu_runtime.finetune.validation import (
    BatchEvaluator,
    CheckpointEvaluation,
    ValidationRun,
    validation_sample,
)


class Checkpointing:
    """Take a trainer's due checkpoints, running their validation passes first (see the module
    docstring)."""

    def __init__(
        self,
        evaluator: BatchEvaluator,
        model: torch.nn.Module,
        device: torch.device,
        progress: OptimizerTail,
        validation_examples: Sequence[TokenizedExample],
        *,
        valid_sample_tokens: int,
        seed: int,
        root: Path | None,
        base_model_name_or_path: str | None,
    ) -> None:
        """``evaluator``: a validation micro-batch's loss and accuracy over ``model`` (the
        training tree) on ``device``; ``progress``: the optimizer tail whose step count and
        latest step record the metrics report; ``validation_examples``: the validation file,
        sampled to at most ``valid_sample_tokens`` tokens with ``seed``; ``root``: where
        checkpoints go (none when None); ``base_model_name_or_path`` is recorded in each
        adapter's config."""
        self.evaluator = evaluator
        """How a validation micro-batch is evaluated (a DPO trainer sets its own)."""
        self.model = model
        self.device = device
        self.progress = progress
        self.validation_examples = tuple(validation_examples)
        self.valid_sample = validation_sample(self.validation_examples, valid_sample_tokens, seed)
        self.root = root
        self.base_model_name_or_path = base_model_name_or_path
        self.last_metrics: dict[str, Any] | None = None
        """The metrics of the latest checkpoint written (:meth:`metrics`)."""
        self._evaluation: CheckpointEvaluation | None = None
        """The validation passes of a due checkpoint, run as quanta before it is written."""

    @property
    def evaluating(self) -> bool:
        """Whether the next quanta run a due checkpoint's validation passes."""
        return self._evaluation is not None

    def validation(
        self, examples: Sequence[TokenizedExample], max_tokens: int = 8192
    ) -> ValidationRun:
        """A validation pass the scheduler can run a micro-batch at a time (see
        :class:`ValidationRun`)."""
        return ValidationRun(self.evaluator, self.model, examples, max_tokens, self.device)

    def evaluate(self, examples: Sequence[TokenizedExample], max_tokens: int = 8192) -> float:
        """Mean validation loss of ``examples`` (a validation file) with the current adapter, in
        one call (:attr:`evaluator`'s loss). Leaves the trainer's state (data position, RNG,
        gradients) untouched."""
        run = self.validation(examples, max_tokens)
        while not run.step():
            pass
        return run.loss

    def _checkpoint_evaluation(self, *, final: bool) -> CheckpointEvaluation:
        history = self.progress.history
        return CheckpointEvaluation(
            self.evaluator,
            self.model,
            self.device,
            self.valid_sample,
            self.validation_examples,
            step=self.progress.step,
            last=history[-1] if history else None,
            final=final,
        )

    def due(self, trainer: CheckpointedTrainer, *, final: bool) -> Path | None:
        """An optimizer step of ``trainer`` made a checkpoint due: with a validation file its
        passes become the next quanta (:meth:`evaluation_step` writes it); without, its
        metrics are the step's own and it is written now (when there is a root)."""
        if self.validation_examples:
            self._evaluation = self._checkpoint_evaluation(final=final)
            return None
        self.metrics(final=final)
        return self.write(trainer)

    def write(self, trainer: CheckpointedTrainer) -> Path | None:
        """Write ``trainer``'s checkpoint under the root now (None: there is no root)."""
        if self.root is None:
            return None
        return save_checkpoint(trainer, self.root, self.base_model_name_or_path)

    def evaluation_step(self, trainer: CheckpointedTrainer, max_tokens: int | None) -> Path | None:
        """One micro-batch (at most ``max_tokens`` padded tokens) of the due checkpoint's
        validation passes (call while :attr:`evaluating`); the last one keeps their metrics and
        writes ``trainer``'s checkpoint, whose path it returns."""
        evaluation = self._evaluation
        if evaluation is None:
            raise RuntimeError("no checkpoint is being evaluated")
        evaluation.step(max_tokens)
        if not evaluation.done:
            return None
        self._evaluation = None
        self.last_metrics = evaluation.metrics()
        return self.write(trainer)

    def evaluation_quantum(
        self, trainer: CheckpointedTrainer, max_tokens: int | None, start: float, *, graphed: bool
    ) -> QuantumResult:
        """:meth:`evaluation_step` as a quantum that began at ``start`` (``time.perf_counter``;
        forward only, synced so that ``wall_s`` is its duration). No example is trained, so
        ``tokens`` is 0; ``graphed``: the trainer runs CUDA graphs, which this quantum does
        not use."""
        written = self.evaluation_step(trainer, max_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        graph: dict[str, Any] = {}
        if graphed:
            graph = {"graph": "eager", "graph_fallback": "validation passes run eagerly"}
        return no_training_result(
            step=trainer.step,
            position=trainer.stream.position,
            finished=trainer.stream.finished and not self.evaluating,
            wall_s=time.perf_counter() - start,
            peak=peak_allocated(self.device),
            checkpoint=written,
            **graph,
        )

    def metrics(self, *, final: bool) -> dict[str, Any]:
        """OpenAI's checkpoint metrics at the current step, every validation pass run in this
        call, kept as :attr:`last_metrics` (see
        :meth:`~gpu_runtime.finetune.validation.CheckpointEvaluation.metrics`)."""
        self.last_metrics = self._checkpoint_evaluation(final=final).evaluate_all()
        return self.last_metrics
