"""`TpotWindow`: the time per output token of a recent window's decode iterations, as a host's
heartbeat reports it (`serving`, over `gpu_runtime.contract.protocol.SERVING_WINDOW_S`).

Each iteration that timed tokens contributes one figure, the mean of its TPOT samples
(`IterationRecord.tpot_samples_ms`, the samples `metrics` aggregates per interval): the
iteration's time per output token. Iterations that timed none (idle, or only first tokens) do
not count. The window holds the figures of iterations that started in the last `window_s`
seconds of the loop's clock, at most `max_iterations` of them, both in arrival order and sorted:
a read (the median, the fraction within the SLO) costs O(log n) and never sorts, so the host
can take it on every turn of its loop.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque

from gpu_runtime.colocation.types import IterationRecord
from gpu_runtime.contract.protocol import SERVING_WINDOW_S

MAX_WINDOW_ITERATIONS = 8192
"""Enough for `SERVING_WINDOW_S` of iterations of 4 ms; older ones leave first beyond it."""


class TpotWindow:
    """See the module docstring. Loop thread only."""

    def __init__(
        self,
        tpot_slo_ms: float,
        window_s: float = SERVING_WINDOW_S,
        max_iterations: int = MAX_WINDOW_ITERATIONS,
    ) -> None:
        if tpot_slo_ms <= 0 or window_s <= 0 or max_iterations < 1:
            raise ValueError(
                f"need tpot_slo_ms > 0, window_s > 0, max_iterations >= 1; got {tpot_slo_ms}, "
                f"{window_s}, {max_iterations}"
            )
        self.tpot_slo_ms = tpot_slo_ms
        self.window_s = window_s
        self.max_iterations = max_iterations
        self._arrivals: deque[tuple[float, float]] = deque()  # (start, TPOT ms), oldest first
        self._sorted: list[float] = []

    def observe(self, record: IterationRecord) -> None:
        """Metrics sink: add the record's iteration if it timed tokens."""
        samples = record.tpot_samples_ms
        if not samples:
            return
        if len(self._arrivals) >= self.max_iterations:
            self._drop_oldest()
        tpot_ms = sum(samples) / len(samples)
        self._arrivals.append((record.timestamp, tpot_ms))
        insort(self._sorted, tpot_ms)

    def figures(self, now: float) -> tuple[float | None, float | None]:
        """The median TPOT (ms) and the fraction within the SLO of the iterations that started
        after `now - window_s` (loop clock); (None, None) when none did. The median is
        `gpu_runtime.contract.statistics.median`'s (interpolated) one."""
        horizon = now - self.window_s
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._drop_oldest()
        ordered = self._sorted
        if not ordered:
            return None, None
        rank = (len(ordered) - 1) / 2
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        median = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
        return median, bisect_right(ordered, self.tpot_slo_ms) / len(ordered)

    def _drop_oldest(self) -> None:
        _, tpot_ms = self._arrivals.popleft()
        del self._sorted[bisect_left(self._sorted, tpot_ms)]
