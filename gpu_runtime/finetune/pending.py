"""A quantum whose GPU work is launched but whose result has not been read yet.

A CUDA-graphed micro-batch costs the host a few launches (copy the inputs, replay the graph,
step the optimizer), so the host loop can launch it on the finetune stream and go straight back
to decode, instead of parking a thread in the quantum's host sync: the loop then asks
:meth:`PendingQuantum.done` (a CUDA event query, no sync) between decode iterations and reads the
result (:meth:`PendingQuantum.result`: the quantum's one host sync, which no longer waits) once
the GPU has finished it. Until then the trainer refuses to start another quantum.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from gpu_runtime.finetune.quantum import QuantumResult


class PendingQuantum:
    """Launched GPU work of one quantum, read once by :meth:`result`."""

    def __init__(
        self,
        read: Callable[[list[float], float | None], QuantumResult],
        values: torch.Tensor | None,
        events: tuple[Any, Any] | None = None,
        ready: QuantumResult | None = None,
    ) -> None:
        """``values``: the device scalars the result needs (read in one sync); ``read`` builds
        the result from them and the GPU milliseconds between ``events`` (start, end: CUDA
        events on the quantum's stream; None when it ran synchronously). ``ready``: a quantum
        that already ran to its end (see :meth:`finished`)."""
        self._read = read
        self._values = values
        self._events = events
        self._result = ready
        self.launched_at = time.perf_counter()

    @classmethod
    def finished(cls, result: QuantumResult) -> PendingQuantum:
        """A quantum that ran synchronously (eager, layer-sliced or on CPU)."""

        def read(values: list[float], gpu_ms: float | None) -> QuantumResult:
            return result

        return cls(read, None, None, result)

    @property
    def is_read(self) -> bool:
        """Whether :meth:`result` has been read (or the quantum ran synchronously)."""
        return self._result is not None

    def done(self) -> bool:
        """Whether the GPU has finished the quantum (never blocks)."""
        if self._result is not None or self._events is None:
            return True
        return bool(self._events[1].query())

    def result(self) -> QuantumResult:
        """The quantum's result (waits for the GPU if it is not :meth:`done`); read once, then
        returned again on later calls."""
        if self._result is None:
            assert self._values is not None
            values = self._values.tolist()  # the quantum's one host sync
            gpu_ms = None
            if self._events is not None:
                gpu_ms = float(self._events[0].elapsed_time(self._events[1]))
            self._result = self._read(values, gpu_ms)
            self._values = None
        return self._result
