"""A validation file's loss and accuracy, one bounded micro-batch at a time (a scheduler can
interleave it), and the metrics a checkpoint carries (OpenAI's names).

At every checkpoint the trainer evaluates a fixed sample of the validation examples (a seeded
choice of at most ``VALID_SAMPLE_TOKENS`` tokens, the same at every checkpoint so the values
compare): ``valid_loss`` and ``valid_<accuracy>``. The final checkpoint also evaluates every
validation example: ``full_valid_loss`` and ``full_valid_<accuracy>``. Both run in eval mode (no
dropout) without gradients, and leave the trainer's state untouched. With a validation file the
trainer runs them as quanta of their own (:meth:`CheckpointEvaluation.step`, one micro-batch of
at most the quantum's token budget each, on the quantum's thread and stream) after the optimizer
step that made a checkpoint due, and writes that checkpoint with the last of them; training
resumes after it (so the checkpoint holds exactly the state that was evaluated).
``train_loss`` and ``train_mean_token_accuracy`` are those of the last optimizer batch, measured
in its own forward.

What one micro-batch's loss and accuracy are is the trainer's
(:attr:`~gpu_runtime.finetune.checkpointing.Checkpointing.evaluator`, a
:class:`BatchEvaluator`): a supervised trainer's is the mean token loss and the fraction of loss
targets the logits' argmax predicts (``mean_token_accuracy``, :class:`TokenLossEvaluator`); a DPO
trainer's the mean DPO loss over pairs and the fraction of pairs ranked right
(``preference_accuracy``; its token-accuracy fields are then null: pairs have no token targets).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch

from gpu_runtime.finetune.quantum import StepRecord
from gpu_runtime.finetune.supervised_loss import SupervisedLoss

VALID_SAMPLE_TOKENS = 16384
"""Token budget of the validation sample evaluated at each checkpoint."""
VALID_MICRO_BATCH_TOKENS = 8192
"""Padded tokens per validation micro-batch."""
CHECKPOINT_METRIC_KEYS = (
    "train_loss",
    "train_mean_token_accuracy",
    "valid_loss",
    "valid_mean_token_accuracy",
    "full_valid_loss",
    "full_valid_mean_token_accuracy",
)


class Measured(Protocol):
    """A validation item: a tokenized example or a preference pair (its padded row tokens)."""

    @property
    def num_tokens(self) -> int: ...


ItemT = TypeVar("ItemT", bound=Measured)


class BatchEvaluator(Protocol):
    """How a trainer evaluates one validation micro-batch (the strategy :class:`ValidationRun`
    runs; called in eval mode without gradients)."""

    accuracy_key: str
    """The accuracy's metric name after ``valid_`` / ``full_valid_``."""

    def __call__(self, items: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(summed loss, summed hits, loss terms)`` of ``items``: fp32 device scalars (not
        synced) and the count both means divide by."""
        ...


class TokenLossEvaluator:
    """A supervised trainer's validation micro-batch: summed token loss, argmax hits over its
    loss targets, and their count."""

    accuracy_key = "mean_token_accuracy"

    def __init__(self, loss: SupervisedLoss) -> None:
        self.loss = loss

    def __call__(self, items: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        batch = self.loss.prepare(items)
        hits = torch.zeros((), dtype=torch.float32, device=self.loss.device)
        return self.loss.loss_sum(batch, hits), hits, batch.num_loss_tokens


class ValidationRun:
    """Mean loss and accuracy (a trainer's :class:`BatchEvaluator`) of a validation set, one
    micro-batch of at most ``max_tokens`` padded tokens per :meth:`step` (``model``, the
    training tree, in eval mode: no dropout; no gradients; trainer state untouched). Items go
    longest first, so each micro-batch holds similar lengths."""

    def __init__(
        self,
        evaluator: BatchEvaluator,
        model: torch.nn.Module,
        examples: Sequence[Measured],
        max_tokens: int,
        device: torch.device,
    ) -> None:
        if not examples:
            raise ValueError("a validation run needs at least one example")
        self.evaluator = evaluator
        self.model = model
        self.examples = list(examples)
        self.max_tokens = max_tokens
        self._order = sorted(range(len(examples)), key=lambda i: -examples[i].num_tokens)
        self._next = 0
        self._total = torch.zeros((), dtype=torch.float32, device=device)
        self._correct = torch.zeros((), dtype=torch.float32, device=device)
        self._count = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self._order)

    @torch.no_grad()
    def step(self, max_tokens: int | None = None) -> bool:
        """Evaluate the next micro-batch (at most ``max_tokens`` padded tokens, default the
        run's; one example at least); returns whether the run is complete."""
        if self.done:
            return True
        longest = self.examples[self._order[self._next]].num_tokens
        rows = max(1, (max_tokens or self.max_tokens) // longest)
        chunk = [self.examples[i] for i in self._order[self._next : self._next + rows]]
        model = self.model
        model.eval()
        try:
            loss_sum, hits, count = self.evaluator(chunk)
        finally:
            model.train()
        self._total += loss_sum
        self._correct += hits
        self._count += count
        self._next += len(chunk)
        return self.done

    @property
    def loss(self) -> float:
        """Mean loss per loss term (once :attr:`done`)."""
        if not self.done:
            raise RuntimeError("validation run not complete")
        return float(self._total.item()) / max(1, self._count)

    @property
    def accuracy(self) -> float:
        """Hits per loss term (once :attr:`done`)."""
        if not self.done:
            raise RuntimeError("validation run not complete")
        return float(self._correct.item()) / max(1, self._count)


def validation_sample(examples: Sequence[ItemT], max_tokens: int, seed: int) -> tuple[ItemT, ...]:
    """A seeded choice of examples totalling at most ``max_tokens`` tokens (at least one
    example when there is any), in file order: the same for every checkpoint of a job."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    chosen: list[int] = []
    used = 0
    for index in order:
        tokens = examples[index].num_tokens
        if chosen and used + tokens > max_tokens:
            continue
        chosen.append(index)
        used += tokens
    return tuple(examples[i] for i in sorted(chosen))


class CheckpointEvaluation:
    """The validation passes of one checkpoint (the sample, and at the final checkpoint the
    full set), one micro-batch per :meth:`step`; :meth:`metrics` once :attr:`done`."""

    def __init__(
        self,
        evaluator: BatchEvaluator,
        model: torch.nn.Module,
        device: torch.device,
        sample: Sequence[Measured],
        full: Sequence[Measured],
        *,
        step: int,
        last: StepRecord | None,
        final: bool,
    ) -> None:
        """``sample``: the validation sample (:func:`validation_sample`), ``full``: every
        validation example; ``step`` and ``last``: the trainer's optimizer steps and its latest
        step record (the ``train_*`` metrics)."""
        self.evaluator = evaluator
        self.final = final
        self.step_number = step
        self.last = last
        micro_batch = VALID_MICRO_BATCH_TOKENS
        self.sample = None
        if sample:
            self.sample = ValidationRun(evaluator, model, sample, micro_batch, device)
        self.full = None
        if final and full and len(full) != len(sample):  # else the sample is the full set
            self.full = ValidationRun(evaluator, model, full, micro_batch, device)

    @property
    def done(self) -> bool:
        return all(run is None or run.done for run in (self.sample, self.full))

    def step(self, max_tokens: int | None = None) -> None:
        """Evaluate the next micro-batch of the first unfinished pass."""
        for run in (self.sample, self.full):
            if run is not None and not run.done:
                run.step(max_tokens)
                return

    def metrics(self) -> dict[str, Any]:
        """Every key of ``CHECKPOINT_METRIC_KEYS``, and ``valid_<accuracy>`` and
        ``full_valid_<accuracy>`` of the evaluator; a value that was not measured (no
        validation file, ``full_*`` before the final checkpoint, no step yet) is None."""
        if not self.done:
            raise RuntimeError("checkpoint evaluation not complete")
        last = self.last
        valid_loss = valid_accuracy = full_loss = full_accuracy = None
        if self.sample is not None:
            valid_loss, valid_accuracy = self.sample.loss, self.sample.accuracy
        if self.full is not None:
            full_loss, full_accuracy = self.full.loss, self.full.accuracy
        elif self.final:
            full_loss, full_accuracy = valid_loss, valid_accuracy
        metrics: dict[str, Any] = {
            "step": self.step_number,
            "train_loss": None if last is None else last.loss,
            "train_mean_token_accuracy": None if last is None else last.accuracy,
            "valid_loss": valid_loss,
            "valid_mean_token_accuracy": None,
            "full_valid_loss": full_loss,
            "full_valid_mean_token_accuracy": None,
        }
        key = self.evaluator.accuracy_key
        metrics[f"valid_{key}"], metrics[f"full_valid_{key}"] = valid_accuracy, full_accuracy
        return metrics

    def evaluate_all(self) -> dict[str, Any]:
        """Every remaining pass in one call, then :meth:`metrics`."""
        while not self.done:
            self.step()
        return self.metrics()
