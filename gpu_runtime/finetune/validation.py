"""A validation file's loss, one bounded micro-batch at a time (a scheduler can interleave it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpu_runtime.finetune.data import TokenizedExample

if TYPE_CHECKING:
    from gpu_runtime.finetune.trainer import LoraTrainer


class ValidationRun:
    """Mean token loss of a validation set, one micro-batch of at most ``max_tokens`` padded
    tokens per :meth:`step` (eval mode: no dropout; no gradients; trainer state untouched).
    Examples go longest first, so each micro-batch holds similar lengths."""

    def __init__(
        self, trainer: LoraTrainer, examples: Sequence[TokenizedExample], max_tokens: int
    ) -> None:
        if not examples:
            raise ValueError("a validation run needs at least one example")
        self.trainer = trainer
        self.examples = list(examples)
        self.max_tokens = max_tokens
        self._order = sorted(range(len(examples)), key=lambda i: -examples[i].num_tokens)
        self._next = 0
        self._total = torch.zeros((), dtype=torch.float32, device=trainer.device)
        self._count = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self._order)

    @torch.no_grad()
    def step(self) -> bool:
        """Evaluate the next micro-batch; returns whether the run is complete."""
        if self.done:
            return True
        longest = self.examples[self._order[self._next]].num_tokens
        rows = max(1, self.max_tokens // longest)
        chunk = [self.examples[i] for i in self._order[self._next : self._next + rows]]
        batch = self.trainer._prepare(chunk)
        self.trainer.model.eval()
        try:
            self._total += self.trainer._loss_sum(batch)
        finally:
            self.trainer.model.train()
        self._count += batch.num_loss_tokens
        self._next += len(chunk)
        return self.done

    @property
    def loss(self) -> float:
        """Mean token loss (once :attr:`done`)."""
        if not self.done:
            raise RuntimeError("validation run not complete")
        return float(self._total.item()) / max(1, self._count)
