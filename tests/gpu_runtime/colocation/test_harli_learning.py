"""What Harli learns from the iterations it observes, on a fake clock with a known analytic
predictor: its safety margin grows with predictions that run persistently low (not with a lone
spike) and with requests that miss the SLO (not with slow prefill iterations), it adapts on a
GPU slower than predicted, and it fits quantum durations (overhead and rate) per choice."""

from __future__ import annotations

import pytest

from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot, LaunchMode
from gpu_runtime.colocation.harli import HarliConfig, HarliPolicy
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.types import InFlightQuantum

from .sim import JOB, FakeGpu, context, record

MODEL = AnalyticLatencyModel()


def test_margin_grows_when_observations_exceed_predictions() -> None:
    policy = HarliPolicy(MODEL, HarliConfig(initial_margin=0.05, min_error_samples=4))
    decode = DecodeSnapshot.from_contexts([512] * 32)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 2.5
    first = policy.plan(context(decode, slo))
    assert first.margin == pytest.approx(0.05)
    assert first.predicted_ms is not None
    flight = InFlightQuantum("job", first.launches[0].max_tokens, first.decode_sms, 0.0)
    for i in range(50):  # iterations with the quantum in flight, all 30% slower than predicted
        plan = policy.plan(context(decode, slo, in_flight=flight))
        assert plan.predicted_ms is not None and not plan.launches
        beside = flight.max_tokens
        rec = record(
            plan, decode, plan.predicted_ms * 1.3, i, beside=beside, beside_sms=flight.decode_sms
        )
        policy.observe(rec)
    launch_ms = policy.launch_overhead.ms
    later = policy.plan(context(decode, slo))
    assert later.margin is not None and later.margin >= 0.3 + 0.03 - 1e-9
    assert first.decode_sms is not None and later.decode_sms is not None
    # A larger margin leaves less room: decode gets at least as many SMs as before.
    assert later.decode_sms >= first.decode_sms
    assert later.predicted_ms is not None
    assert later.predicted_ms - launch_ms <= slo * (1 - later.margin)


def test_adapts_on_a_fake_gpu_that_is_slower_than_predicted() -> None:
    """The predictor says 1.0x, the GPU does 1.25x: after a short warm-up the SLO holds."""
    truth = AnalyticLatencyModel(
        base_ms=6.25,
        per_seq_ms=0.025,
        per_ctx_token_us=0.0625,
        per_prefill_token_us=25.0,
        spatial_interference=0.1,
    )
    gpu = FakeGpu(truth)
    policy = HarliPolicy(
        MODEL, HarliConfig(initial_margin=0.0, base_margin=0.0, min_error_samples=4)
    )
    decode = DecodeSnapshot.from_contexts([700] * 48)
    slo = truth.predict_ms(decode_iteration(decode, 1.0), None) * 1.6
    for _ in range(400):
        gpu.step(policy, decode, slo)
    late = gpu.tpots[100:]
    assert sum(t <= slo for t in late) / len(late) >= 0.99
    assert gpu.finetune_tokens > 0
    assert policy.margins.margin >= 0.2


def test_quantum_durations_fit_overhead_and_rate_per_choice() -> None:
    from gpu_runtime.colocation.harli import QuantumDurations

    durations = QuantumDurations(prior_overhead_ms=10.0)
    job = JOB.__class__("job", 256, 256, 16, tokens_per_s_solo=10_000.0)
    # Never observed: prior overhead + tokens at the solo rate scaled by the SM share.
    assert durations.duration_ms(job, 64, LaunchMode.CONCURRENT, 0.5, 1000) == pytest.approx(
        10.0 + 1000 / 5000 * 1e3
    )
    for tokens in (256, 512, 1024, 256, 2048):
        durations.observe(64, LaunchMode.CONCURRENT, tokens, 30.0 + tokens / 8000 * 1e3)
    assert durations.duration_ms(job, 64, LaunchMode.CONCURRENT, 0.5, 4096) == pytest.approx(
        30.0 + 4096 / 8000 * 1e3
    )
    durations.observe(None, LaunchMode.AFTER_DECODE, 1000, 110.0)
    assert durations.solo_rate(job) == pytest.approx(1000 / 0.1)  # (110 - 10) ms per 1000


def test_margin_reacts_to_persistent_bias_not_to_a_lone_spike() -> None:
    from gpu_runtime.colocation.harli import MarginTracker

    config = HarliConfig(base_margin=0.02, error_quantile=0.98, error_smoothing=16)
    spiky = MarginTracker(config)
    for i in range(200):
        spiky.observe(10.0, 30.0 if i == 100 else 10.0, tpot_slo_ms=15.0)
    biased = MarginTracker(config)
    for _ in range(200):
        biased.observe(10.0, 13.0, tpot_slo_ms=15.0)
    assert spiky.margin < 0.15
    assert biased.margin == pytest.approx(0.02 + 0.3)


def test_margin_bumps_on_requests_missing_the_slo_not_on_slow_prefill_iterations() -> None:
    from dataclasses import replace as _replace

    from gpu_runtime.colocation.types import FinishedRequest

    policy = HarliPolicy(MODEL, HarliConfig(min_error_samples=4, initial_margin_predictions=0))
    decode = DecodeSnapshot.from_contexts([512] * 16)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 2.0
    for i in range(20):  # iterations slower than the SLO (prefill chunks), exactly predicted
        plan = policy.plan(context(decode, slo))
        assert plan.predicted_ms is not None
        slow = _replace(plan, predicted_ms=slo * 1.5)
        met = FinishedRequest(f"ok{i}", 100, slo * 0.9, None)
        policy.observe(_replace(record(slow, decode, slo * 1.5, index=i), finished=(met,)))
    calm = policy.margins.margin
    assert calm == pytest.approx(HarliConfig().base_margin)
    plan = policy.plan(context(decode, slo))
    assert plan.predicted_ms is not None
    missed = FinishedRequest("late", 100, slo * 1.1, None)
    policy.observe(_replace(record(plan, decode, plan.predicted_ms, index=20), finished=(missed,)))
    assert policy.margins.margin == pytest.approx(calm + HarliConfig().violation_step, rel=0.05)
