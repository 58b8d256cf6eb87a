"""Learning-rate schedule: linear warmup from 0, then cosine or linear decay to 0.

A pure function of the optimizer-step count, so its whole state is that count (saved with
the checkpoint) plus the settings it was built with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpu_runtime.contract.hparams import LrScheduleKind


@dataclass(frozen=True)
class LrSchedule:
    """``rate(step)`` is the learning rate for the update that makes step ``step + 1``."""

    peak_learning_rate: float
    total_steps: int
    warmup_steps: int
    kind: LrScheduleKind = "cosine"

    def __post_init__(self) -> None:
        if self.total_steps < 1 or not 0 <= self.warmup_steps < max(2, self.total_steps):
            raise ValueError(
                f"need total_steps >= 1 and 0 <= warmup_steps < total_steps, got "
                f"total_steps={self.total_steps}, warmup_steps={self.warmup_steps}"
            )

    @classmethod
    def from_ratio(
        cls, peak_learning_rate: float, total_steps: int, warmup_ratio: float, kind: LrScheduleKind
    ) -> LrSchedule:
        warmup = min(math.ceil(warmup_ratio * total_steps), max(0, total_steps - 1))
        return cls(peak_learning_rate, total_steps, warmup, kind)

    def rate(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_learning_rate * (step + 1) / (self.warmup_steps + 1)
        decay_steps = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.kind == "linear":
            return self.peak_learning_rate * (1.0 - progress)
        return self.peak_learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
