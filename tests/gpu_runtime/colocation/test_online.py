"""The online-fitted stage-1/2 model recovers a known linear latency law."""

from __future__ import annotations

import random

import pytest

from gpu_runtime.colocation import AnalyticLatencyModel
from gpu_runtime.colocation.online import OnlineLatencyModel
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum


def test_fits_stage_one_per_split_and_interference_ratios() -> None:
    truth = AnalyticLatencyModel(share_exponent=0.5, spatial_interference=0.07)
    model = OnlineLatencyModel(min_samples=8)
    rng = random.Random(0)
    for share in (0.5, 1.0):
        for _ in range(60):
            batch = rng.randint(1, 128)
            ctx = batch * rng.randint(64, 2048)
            it = DecodeIteration(batch, ctx, ctx, rng.choice([0, 0, 256]), share)
            model.observe(it, None, truth.predict_ms(it, None) * rng.uniform(0.99, 1.01))
    quantum = FinetuneQuantum(1024, 256, 16, True, 0.5)
    for _ in range(20):
        it = DecodeIteration(32, 32 * 600, 600, 0, 0.5)
        model.observe(it, quantum, truth.predict_ms(it, quantum))
    probe = DecodeIteration(64, 64 * 1000, 1000, 0, 0.5)
    assert model.predict_ms(probe, None) == pytest.approx(truth.predict_ms(probe, None), rel=0.03)
    assert model.predict_ms(probe, quantum) == pytest.approx(
        truth.predict_ms(probe, quantum), rel=0.03
    )
    assert model.interference_ratio(0.5, disjoint=True) == pytest.approx(1.07, rel=0.02)
    assert model.fitted_shares == [0.5, 1.0]


def test_unobserved_split_uses_the_prior_or_refuses() -> None:
    it = DecodeIteration(8, 800, 100, 0, 0.25)
    with pytest.raises(LookupError):
        OnlineLatencyModel().predict_ms(it, None)
    prior = AnalyticLatencyModel()
    assert OnlineLatencyModel(prior).predict_ms(it, None) == prior.predict_ms(it, None)


def test_thin_split_uses_the_pooled_fit_over_all_splits() -> None:
    """A split with fewer than ``min_samples`` observations is predicted by the fit pooled over
    every split (exact here: the truth is linear in the features and in 1 / share)."""
    truth = AnalyticLatencyModel(share_exponent=1.0)
    model = OnlineLatencyModel(min_samples=8)
    rng = random.Random(1)
    for share, n in ((0.5, 40), (1.0, 40), (0.25, 3)):
        for _ in range(n):
            batch = rng.randint(1, 64)
            ctx = batch * rng.randint(64, 1024)
            it = DecodeIteration(batch, ctx, ctx, rng.choice([0, 128]), share)
            model.observe(it, None, truth.predict_ms(it, None))
    assert model.fitted_shares == [0.5, 1.0]
    assert model.pooled
    assert model.samples() == {0.25: 3, 0.5: 40, 1.0: 40}
    probe = DecodeIteration(16, 16 * 500, 500, 0, 0.25)
    assert model.predict_ms(probe, None) == pytest.approx(truth.predict_ms(probe, None), rel=0.02)


def test_slopes_are_never_negative_so_other_load_ranges_stay_sane() -> None:
    """Observed on a high-load range where bigger batches happened to run faster (prefill came
    with the small ones): the fit keeps no negative slope, so a low-load batch is not predicted
    slower than anything seen."""
    model = OnlineLatencyModel(min_samples=8)
    rng = random.Random(2)
    for _ in range(60):
        batch = rng.randint(30, 60)
        it = DecodeIteration(batch, batch * 500, 500, 0, 1.0)
        model.observe(it, None, 12.0 - 0.1 * batch + rng.uniform(-0.2, 0.2))
    observed_max = 12.0 - 0.1 * 30 + 0.2
    small = DecodeIteration(2, 1000, 500, 0, 1.0)
    large = DecodeIteration(120, 60_000, 500, 0, 1.0)
    assert 0.1 < model.predict_ms(small, None) <= observed_max
    assert model.predict_ms(large, None) >= model.predict_ms(small, None)


def test_a_quantum_run_after_decode_is_not_counted_as_decode_latency() -> None:
    from gpu_runtime.colocation import DecodeSnapshot, IterationPlan, LaunchMode, QuantumReport

    from .sim import record

    model = OnlineLatencyModel(min_samples=4)
    rng = random.Random(3)
    for i in range(20):
        batch = rng.randint(1, 32)
        decode = DecodeSnapshot.from_contexts([400] * batch)
        slice_ms = rng.uniform(2.0, 8.0)  # a layer slice after the decode step
        after = QuantumReport("job", 0, slice_ms, LaunchMode.AFTER_DECODE, 132, layer_passes=2)
        plan = IterationPlan(decode_sms=132)
        model.observe_record(record(plan, decode, 5.0 + 0.1 * batch + slice_ms, i, (after,)))
    probe = DecodeIteration(16, 16 * 400, 400, 0, 1.0)
    assert model.predict_ms(probe, None) == pytest.approx(5.0 + 0.1 * 16, rel=0.02)
