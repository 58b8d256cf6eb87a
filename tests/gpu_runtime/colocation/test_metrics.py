"""Interval metrics from hand-made records (definitions in gpu_runtime.colocation.metrics)."""

from __future__ import annotations

import pytest

from gpu_runtime.colocation import (
    DecodeSnapshot,
    FinishedRequest,
    IterationPlan,
    LaunchMode,
    MetricsAggregator,
    QuantumReport,
)
from gpu_runtime.contract.statistics import percentile

from .sim import record


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_interval_metrics() -> None:
    agg = MetricsAggregator(tpot_slo_ms=10.0, start=0.0)
    decode = DecodeSnapshot.from_contexts([100, 100])
    plan = IterationPlan(decode_sms=66, predicted_ms=8.0)
    quantum = QuantumReport("j", 300, 20.0, LaunchMode.CONCURRENT, 66)
    first = record(plan, decode, 8.0, quanta=(quantum,))
    done = (
        FinishedRequest("a", 5, 9.0, 30.0),
        FinishedRequest("b", 7, 12.0, None),
        FinishedRequest("c", 1, None, 5.0),
    )
    second = record(plan, decode, 12.0, index=1)
    second = second.__class__(**{**second.__dict__, "finished": done})
    agg.add(first)
    agg.add(second)
    m = agg.flush(2.0)
    assert m.iterations == 2 and m.tpot_samples == 4
    assert m.tpot_ms_p50 == pytest.approx(10.0)
    assert m.finished_requests == 2 and m.slo_attainment == 0.5
    assert m.token_slo_attainment == 0.5
    assert m.goodput_tokens_per_s == pytest.approx(5 / 2.0)
    assert m.finetune_tokens == 300 and m.finetune_tokens_per_s == 150.0
    assert m.decode_sm_share_mean == pytest.approx(0.5)
    assert m.prediction_mape == pytest.approx((0.0 + 4.0 / 12.0) / 2)
    assert m.ttft_ms_p50 == pytest.approx(17.5)
    assert m.ttft_ms_p99 == pytest.approx(29.75)
    empty = agg.flush(3.0)
    assert empty.start == 2.0 and empty.iterations == 0 and empty.slo_attainment is None
