"""Layer-sliced quanta for Harli: where a micro-batch stands and what a slice of it costs.

A whole quantum (a micro-batch's forward and backward) carries a large fixed cost (mostly host
work), far more than the slack of one decode iteration. ``step_quantum(max_layers=k)`` runs only
``k`` decoder-layer passes of the micro-batch in progress (``2 x layers`` passes in all: forward
slices bottom up, then backward slices top down, each backward call running whole forward
slices, at least one), so training can advance inside the slack a few layers at a time; tokens
count when the micro-batch completes.

:class:`SliceState` follows the micro-batch in progress from the policy's own launches and the
quantum reports (it never reads the trainer), so it knows how many passes remain and how many
passes the next backward call will run at least. :class:`SliceCosts` predicts a slice's
duration: a fixed cost per call plus a cost per forward and per backward layer pass when those
were measured (``HarliConfig.slice_call_ms`` and the two after it), else the whole quantum's
expected duration spread over the passes (a forward
pass a third of a layer's work, a backward pass two thirds); times a correction learnt from
observed slices per launch choice (a high quantile of observed / predicted, so a slice that ran
long makes the next estimate safer).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_runtime.colocation.types import LaunchMode, QuantumReport

FORWARD_SHARE = 1.0 / 3.0
"""Fraction of a micro-batch's layer work in its forward pass (backward: the rest)."""


@dataclass
class SliceState:
    """The layer-sliced micro-batch in progress for one job (None fields: none in progress)."""

    layers: int
    """Decoder layers of the model (``2 x layers`` passes per micro-batch)."""
    job_id: str | None = None
    examples: int = 0
    tokens: int = 0
    """Token cap the micro-batch was started with."""
    forward_widths: list[int] = field(default_factory=list)
    """Layers of each forward slice run so far (bottom up); backward pops them top down."""
    backward_done: int = 0

    @property
    def active(self) -> bool:
        return self.job_id is not None

    @property
    def forward_done(self) -> int:
        return sum(self.forward_widths)

    @property
    def passes_done(self) -> int:
        return self.forward_done + self.backward_done

    @property
    def passes_left(self) -> int:
        return 2 * self.layers - self.passes_done if self.active else 2 * self.layers

    def start(self, job_id: str, examples: int, tokens: int) -> None:
        self.job_id, self.examples, self.tokens = job_id, examples, tokens
        self.forward_widths, self.backward_done = [], 0

    def clear(self) -> None:
        self.job_id, self.examples, self.tokens = None, 0, 0
        self.forward_widths, self.backward_done = [], 0

    def passes_for(self, max_layers: int) -> tuple[int, int]:
        """(forward passes, backward passes) a ``step_quantum(max_layers)`` call would run now."""
        forward_left = self.layers - self.forward_done
        if forward_left > 0:
            return min(max_layers, forward_left), 0
        # Backward: whole forward slices from the top while they fit, always at least one.
        ran = 0
        pending = self.forward_widths[: len(self.forward_widths) - self._popped()]
        for width in reversed(pending):
            if ran and ran + width > max_layers:
                break
            ran += width
        return 0, ran

    def _popped(self) -> int:
        """Forward slices whose backward already ran."""
        count, done = 0, self.backward_done
        for width in reversed(self.forward_widths):
            if done <= 0:
                break
            done -= width
            count += 1
        return count

    def observe(self, report: QuantumReport) -> None:
        """Advance with a report of this job (whole quanta and completed micro-batches clear)."""
        if report.job_id != self.job_id or report.error is not None:
            if report.error is not None and report.job_id == self.job_id:
                self.clear()
            return
        if report.micro_batch_done:
            self.clear()
            return
        passes = report.layer_passes
        forward_left = self.layers - self.forward_done
        if forward_left > 0:
            self.forward_widths.append(min(passes, forward_left))
            passes -= min(passes, forward_left)
        self.backward_done += passes


class SliceCosts:
    """Predicted duration of a slice: a per-call cost plus per forward and backward layer pass
    (measured figures when given, else the whole quantum's expected duration spread over its
    passes), times a learnt correction per (decode split, mode) (see the module docstring)."""

    def __init__(
        self,
        call_ms: float | None = None,
        forward_layer_ms: float | None = None,
        backward_layer_ms: float | None = None,
        quantile: float = 0.9,
        window: int = 64,
    ) -> None:
        given = (call_ms, forward_layer_ms, backward_layer_ms)
        if any(v is not None for v in given) and (
            None in given or min(v for v in given if v is not None) < 0
        ):
            raise ValueError(f"slice costs need all three figures >= 0 or none, got {given}")
        self.measured = None if call_ms is None else given
        self.quantile = quantile
        self._ratios: dict[tuple[int | None, LaunchMode], deque[float]] = {}
        self._window = window

    def base_ms(self, whole_ms: float, layers: int, forward: int, backward: int) -> float:
        """Uncorrected estimate of a call running these passes."""
        if self.measured is not None:
            call, per_forward, per_backward = self.measured
            assert call is not None and per_forward is not None and per_backward is not None
            return call + per_forward * forward + per_backward * backward
        return self.spread_ms(whole_ms, layers, forward, backward)

    @staticmethod
    def spread_ms(whole_ms: float, layers: int, forward: int, backward: int) -> float:
        """These passes' share of a whole quantum's ``whole_ms``."""
        return whole_ms * (
            FORWARD_SHARE * forward / layers + (1 - FORWARD_SHARE) * backward / layers
        )

    def correction(self, decode_sms: int | None, mode: LaunchMode) -> float:
        ratios = self._ratios.get((decode_sms, mode))
        if not ratios:
            return 1.0
        ordered = sorted(ratios)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def predict_ms(
        self,
        whole_ms: float,
        layers: int,
        forward: int,
        backward: int,
        decode_sms: int | None,
        mode: LaunchMode,
    ) -> float:
        base = self.base_ms(whole_ms, layers, forward, backward)
        return base * self.correction(decode_sms, mode)

    def observe(
        self, decode_sms: int | None, mode: LaunchMode, predicted_base_ms: float, ms: float
    ) -> None:
        """One slice that took ``ms`` where the uncorrected estimate was ``predicted_base_ms``."""
        if predicted_base_ms <= 0 or ms <= 0:
            return
        key = (decode_sms, mode)
        self._ratios.setdefault(key, deque(maxlen=self._window)).append(ms / predicted_base_ms)
