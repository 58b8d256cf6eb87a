"""Baseline policies behave as defined."""

from __future__ import annotations

import pytest

from gpu_runtime.colocation import (
    AnalyticLatencyModel,
    DecodeOnlyPolicy,
    DecodeSnapshot,
    LaunchMode,
    NaivePolicy,
    QuantumReport,
    StaticSplitPolicy,
    TimeSlicePolicy,
    validate_plan,
)
from gpu_runtime.colocation.corrected import CorrectedLatencyModel
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.types import InFlightQuantum

from .sim import JOB, TOTAL_SMS, context, record

DECODE = DecodeSnapshot.from_contexts([512] * 32)
FLIGHT = InFlightQuantum("job", 512, TOTAL_SMS, 0.0)


def test_decode_only_never_launches() -> None:
    for ctx in (context(DECODE, 10.0), context(DecodeSnapshot(0, 0, 0), 10.0)):
        plan = DecodeOnlyPolicy().plan(ctx)
        validate_plan(plan, ctx)
        assert plan.launches == () and plan.decode_sms == TOTAL_SMS


def test_naive_runs_a_quantum_whenever_none_is_in_flight_on_the_whole_device() -> None:
    policy = NaivePolicy(quantum_examples=3)
    plan = policy.plan(context(DECODE, 1.0))  # ignores the SLO entirely
    assert plan.decode_sms == TOTAL_SMS
    (launch,) = plan.launches
    assert launch.mode is LaunchMode.CONCURRENT and launch.max_tokens == 3 * JOB.max_seq_len
    assert policy.plan(context(DECODE, 1.0, in_flight=FLIGHT)).launches == ()
    assert policy.plan(context(DECODE, 1.0, jobs=())).launches == ()


def test_static_split_keeps_its_split() -> None:
    policy = StaticSplitPolicy(decode_sms=64, quantum_examples=2)
    for ctx in (context(DECODE, 10.0), context(DECODE, 10.0, in_flight=FLIGHT)):
        plan = policy.plan(ctx)
        validate_plan(plan, ctx)
        assert plan.decode_sms == 64
    assert policy.plan(context(DECODE, 10.0)).launches[0].mode is LaunchMode.CONCURRENT
    assert policy.plan(context(DECODE, 10.0, spatial=False)).decode_sms is None


def test_time_slice_fills_only_the_slack_after_decode() -> None:
    model = AnalyticLatencyModel()
    policy = TimeSlicePolicy(model, margin=0.1, max_quantum_examples=8)
    solo = model.predict_ms(decode_iteration(DECODE, 1.0), None)
    slo = solo + 20.0
    first = policy.plan(context(DECODE, slo))
    (launch,) = first.launches
    assert launch.mode is LaunchMode.AFTER_DECODE and first.decode_sms == TOTAL_SMS
    assert launch.max_tokens == JOB.max_seq_len  # one example until a quantum was timed
    # Observed: 4 ms per 256-token example -> slack of 0.9 * slo - solo fits this many.
    policy.observe(
        record(
            first,
            DECODE,
            solo + 4.0,
            quanta=(QuantumReport("job", 256, 4.0, LaunchMode.AFTER_DECODE, TOTAL_SMS),),
        )
    )
    second = policy.plan(context(DECODE, slo))
    expected = min(8, int((0.9 * slo - solo) / 4.0))
    assert second.launches[0].max_tokens == expected * JOB.max_seq_len
    assert second.predicted_ms == pytest.approx(solo + expected * 4.0)
    tight = policy.plan(context(DECODE, solo * 1.05))
    assert tight.launches == () and tight.paused
    idle = policy.plan(context(DecodeSnapshot(0, 0, 0), slo))
    assert idle.launches[0].max_tokens == 8 * JOB.max_seq_len


def test_time_slice_teaches_a_learning_model_the_decode_step_without_the_quantum() -> None:
    model = CorrectedLatencyModel(AnalyticLatencyModel(), min_samples=4)
    policy = TimeSlicePolicy(model, margin=0.1, max_quantum_examples=8)
    solo = AnalyticLatencyModel().predict_ms(decode_iteration(DECODE, 1.0), None)
    slo = 3 * solo + 20.0
    after = (QuantumReport("job", 256, 4.0, LaunchMode.AFTER_DECODE, TOTAL_SMS),)
    for _ in range(4):  # decode took 2x its prediction; the quantum after it is not decode's
        plan = policy.plan(context(DECODE, slo))
        policy.observe(record(plan, DECODE, 2 * solo + 4.0, quanta=after))
    plan = policy.plan(context(DECODE, slo))
    assert plan.predicted_solo_ms == pytest.approx(2 * solo)
    expected = min(8, int((0.9 * slo - 2 * solo) / 4.0))
    assert plan.launches[0].max_tokens == expected * JOB.max_seq_len
