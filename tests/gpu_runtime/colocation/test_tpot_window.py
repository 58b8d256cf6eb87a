"""The heartbeat's TPOT window over hand-made records: one figure per decode iteration (the mean
of its samples), the last `window_s` seconds only, bounded, median as the contract defines it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gpu_runtime.colocation import DecodeSnapshot, IterationPlan, IterationRecord, TpotWindow
from gpu_runtime.contract.statistics import median

from .sim import record

_BASE = record(IterationPlan(), DecodeSnapshot.from_contexts([10, 10]), 5.0)


def _iteration(start: float, *samples_ms: float) -> IterationRecord:
    return replace(_BASE, timestamp=start, tpot_samples_ms=samples_ms)


def test_figures_per_iteration_within_the_window() -> None:
    window = TpotWindow(tpot_slo_ms=20.0, window_s=30.0)
    assert window.figures(0.0) == (None, None)
    window.observe(_iteration(0.0))  # only first tokens: not a decode figure
    assert window.figures(0.0) == (None, None)
    window.observe(_iteration(1.0, 10.0, 14.0))  # its figure: 12
    window.observe(_iteration(2.0, 30.0))
    window.observe(_iteration(3.0, 16.0, 16.0, 16.0))
    assert window.figures(3.0) == (16.0, 2 / 3)
    window.observe(_iteration(4.0, 20.0))  # at the SLO counts as within
    assert window.figures(4.0) == (18.0, 3 / 4)
    assert window.figures(31.0) == (18.0, 3 / 4)  # the first started 30 s before: still in
    assert window.figures(31.5) == (20.0, 2 / 3)  # the 12 has left
    assert window.figures(33.5) == (20.0, 1.0)  # only the 20 is left
    assert window.figures(60.0) == (None, None)


def test_bounded_oldest_first_and_the_contract_median() -> None:
    window = TpotWindow(tpot_slo_ms=50.0, window_s=30.0, max_iterations=100)
    rng = random.Random(0)
    values = [rng.uniform(1.0, 100.0) for _ in range(250)]
    for i, value in enumerate(values):
        window.observe(_iteration(i * 0.01, value))
    p50, attainment = window.figures(2.5)
    kept = values[-100:]
    assert p50 == pytest.approx(median(kept), abs=1e-12)
    assert attainment == sum(1 for v in kept if v <= 50.0) / 100
    for i, value in enumerate(values[:10]):  # repeated figures leave one at a time
        window.observe(_iteration(3.0 + i * 0.01, value))
    assert window.figures(3.1)[0] == pytest.approx(median(values[160:] + values[:10]))


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="tpot_slo_ms > 0"):
        TpotWindow(tpot_slo_ms=0.0)
    with pytest.raises(ValueError, match="max_iterations >= 1"):
        TpotWindow(tpot_slo_ms=1.0, max_iterations=0)
