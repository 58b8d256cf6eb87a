"""Percentiles of timed samples, by the one definition every report shares
(`gpu_runtime.contract.statistics.percentile`: linear interpolation)."""

from __future__ import annotations

from collections.abc import Sequence

from gpu_runtime.contract.statistics import percentile


def sample_percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of a timed run's samples; a timed run without samples is an
    error (the contract's None is for reports that may have nothing to summarise)."""
    value = percentile(samples, q)
    if value is None:
        raise ValueError(f"the {q}th percentile of no samples")
    return value
