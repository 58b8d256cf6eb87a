"""What raises Harli's margin after requests miss, and how it ages (fake clock, analytic model)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot
from gpu_runtime.colocation.harli import HarliConfig, HarliPolicy, MarginTracker
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.types import IterationContext, RunningRequest

from .sim import context, record

MODEL = AnalyticLatencyModel()
DECODE = DecodeSnapshot.from_contexts([512] * 16)
SLO = MODEL.predict_ms(decode_iteration(DECODE, 1.0), None) * 2.0


def _with_running(*running: RunningRequest, slo: float = SLO) -> IterationContext:
    return replace(
        context(DECODE, slo), running=running, worst_running_tpot_ms=max(r.tpot_ms for r in running)
    )


def _step(policy: HarliPolicy, ctx: IterationContext, index: int) -> None:
    """Plan one iteration and report it back as observed exactly as predicted."""
    plan = policy.plan(ctx)
    observed = plan.predicted_ms if plan.predicted_ms is not None else ctx.tpot_slo_ms * 0.5
    policy.observe(record(plan, ctx.decode, observed, index=index))


def test_an_early_mean_over_the_slo_that_decode_alone_brings_back_is_no_breach() -> None:
    """A request whose first tokens carried prefill chunks is over the SLO so far, but with its
    remaining tokens at decode alone's typical iteration it ends well under: no bump. One that
    would stay over even then (few tokens left) is a breach, once per episode."""
    config = HarliConfig(min_error_samples=4, replan_backoff=0, initial_margin_predictions=0)
    policy = HarliPolicy(MODEL, config)
    for i in range(10):
        _step(policy, context(DECODE, SLO), i)
    calm = policy.margins.margin
    assert calm == pytest.approx(config.base_margin)
    alone = policy.predictions.typical_ms(DECODE, 1.0, None)
    early = RunningRequest(tokens=20, tpot_ms=SLO * 1.3, remaining_tokens=300)
    assert early.final_tpot_ms(alone, config.unknown_remaining_tokens) < SLO
    for i in range(10, 20):
        _step(policy, _with_running(early), i)
    assert policy.margins.margin == pytest.approx(calm)
    late = RunningRequest(tokens=200, tpot_ms=SLO * 1.3, remaining_tokens=10)
    assert late.final_tpot_ms(alone, config.unknown_remaining_tokens) > SLO
    for i in range(20, 25):  # one episode: one step, however many iterations it lasts
        _step(policy, _with_running(late), i)
    bumped = policy.margins.margin
    step = config.violation_step * config.violation_decay**4
    assert bumped == pytest.approx(calm + step, rel=1e-6)


def test_without_a_prediction_of_decode_alone_yet_the_mean_so_far_decides() -> None:
    policy = HarliPolicy(MODEL, HarliConfig(replan_backoff=0))
    over = RunningRequest(tokens=20, tpot_ms=SLO * 1.3, remaining_tokens=300)
    assert policy.feedback.headed_over(_with_running(over), None)
    under = RunningRequest(tokens=20, tpot_ms=SLO * 0.9, remaining_tokens=300)
    assert not policy.feedback.headed_over(_with_running(under), None)


def test_the_breach_term_ages_in_backoff_iterations_that_predict_nothing() -> None:
    """Under overload most plans back off (no prediction): the margin a breach added must still
    decay per busy iteration, or harli stays paused long after decode has recovered."""
    config = HarliConfig(replan_backoff=4, min_error_samples=4)
    policy = HarliPolicy(MODEL, config)
    heavy = DecodeSnapshot.from_contexts([1024] * 64)
    tight = MODEL.predict_ms(decode_iteration(heavy, 1.0), None) * 1.01  # nothing fits
    lost = RunningRequest(tokens=200, tpot_ms=tight * 1.5, remaining_tokens=5)
    ctx = replace(context(heavy, tight), running=(lost,), worst_running_tpot_ms=lost.tpot_ms)
    _step(policy, ctx, 0)  # a breach episode begins
    calm_ctx = context(heavy, tight)
    notes = []
    for i in range(1, 101):
        plan = policy.plan(calm_ctx)
        notes.append(plan.note)
        policy.observe(record(plan, heavy, tight * 0.9, index=i))
    assert notes.count("backing off") > 50  # most iterations asked the model nothing
    violation = policy.margins._violation
    assert violation == pytest.approx(config.violation_step * config.violation_decay**100)


def test_margin_tracker_counts_errors_only_from_predicted_iterations() -> None:
    config = HarliConfig(min_error_samples=2, base_margin=0.02)
    tracker = MarginTracker(config)
    for _ in range(10):
        tracker.observe(10.0, 12.0, tpot_slo_ms=20.0)
    biased = tracker.margin
    assert biased == pytest.approx(0.02 + 0.2)
    for _ in range(50):  # unpredicted iterations: no error, no breach, the margin holds
        tracker.observe(None, 40.0, tpot_slo_ms=20.0, requests_breached=False)
    assert tracker.margin == pytest.approx(biased)
    tracker.observe(None, 40.0, tpot_slo_ms=20.0, requests_breached=True)
    assert tracker.margin == pytest.approx(biased + config.violation_step)


def test_errors_leave_the_window_after_error_window_busy_iterations_predicted_or_not() -> None:
    """Under backoff few iterations predict: the error window is a span of busy iterations, so
    early errors stop counting when that span has passed, however few predictions it held; the
    newest ``min_error_samples`` errors always stay (no fall back to the initial margin)."""
    config = HarliConfig(
        base_margin=0.02,
        error_window=64,
        min_error_samples=4,
        error_smoothing=1,
        initial_margin_predictions=0,
    )
    tracker = MarginTracker(config)
    for _ in range(10):
        tracker.observe(10.0, 13.0, tpot_slo_ms=20.0)  # 30% under-predicted
    assert tracker.margin == pytest.approx(0.02 + 0.3)
    for i in range(200):  # mostly backoff: every 10th iteration predicts, exactly
        tracker.observe(10.0 if i % 10 == 0 else None, 10.0, 20.0, requests_breached=False)
    assert tracker.margin == pytest.approx(0.02)
    quiet = MarginTracker(config)
    for _ in range(10):
        quiet.observe(10.0, 11.0, tpot_slo_ms=20.0)
    for _ in range(500):  # nothing predicted for a long time: the last errors still stand
        quiet.observe(None, 10.0, 20.0, requests_breached=False)
    assert quiet.margin == pytest.approx(0.02 + 0.1)


def test_the_initial_margin_fades_out_under_the_learnt_one() -> None:
    """Exact predictions from the start: the learnt margin is the base one, but the initial
    margin stays a floor that falls linearly to nothing over ``initial_margin_predictions``
    predictions (unpredicted iterations do not age it); a learnt margin above the floor wins."""
    config = HarliConfig(
        base_margin=0.02, initial_margin=0.2, min_error_samples=4, initial_margin_predictions=100
    )
    tracker = MarginTracker(config)
    for _ in range(3):
        tracker.observe(10.0, 10.0, tpot_slo_ms=20.0)
    assert tracker.margin == pytest.approx(0.2)  # too few errors: the initial margin itself
    for _ in range(22):
        tracker.observe(10.0, 10.0, tpot_slo_ms=20.0)
    assert tracker.margin == pytest.approx(0.2 * (1 - 25 / 100))
    for _ in range(40):  # no predictions: the floor holds
        tracker.observe(None, 10.0, tpot_slo_ms=20.0, requests_breached=False)
    assert tracker.margin == pytest.approx(0.2 * (1 - 25 / 100))
    for _ in range(25):
        tracker.observe(10.0, 10.0, tpot_slo_ms=20.0)
    assert tracker.margin == pytest.approx(0.2 * (1 - 50 / 100))
    for _ in range(50):
        tracker.observe(10.0, 10.0, tpot_slo_ms=20.0)
    assert tracker.margin == pytest.approx(0.02)  # faded: the learnt margin alone
    biased = MarginTracker(config)
    for _ in range(10):  # 30% under-predicted: the learnt margin is above the floor
        biased.observe(10.0, 13.0, tpot_slo_ms=20.0)
    assert biased.margin == pytest.approx(0.02 + 0.3)
    unfaded = MarginTracker(replace(config, initial_margin_predictions=0))
    for _ in range(10):
        unfaded.observe(10.0, 10.0, tpot_slo_ms=20.0)
    assert unfaded.margin == pytest.approx(0.02)
    with pytest.raises(ValueError, match="initial_margin_predictions must be >= 0, got -1"):
        HarliConfig(initial_margin_predictions=-1)


def test_a_paused_plans_own_search_time_is_no_prediction_error() -> None:
    """Decode alone (nothing safe) judged without the plan's host time: a search that took
    20% of the iteration leaves the margin as it was, while decode alone really running 20%
    over its prediction raises it. (On the H200 a paused plan's 0.75 ms search counted as error and
    kept the margin at 0.38-0.44 for 1.2 s while harli stayed paused.)"""
    config = HarliConfig(min_error_samples=4, replan_backoff=0, initial_margin_predictions=0)
    policy = HarliPolicy(MODEL, config)
    for i in range(10):
        _step(policy, context(DECODE, SLO), i)
    calm = policy.margins.margin
    alone = policy.plan(context(DECODE, SLO, jobs=()))
    assert not alone.launches and alone.predicted_ms is not None
    search_ms = alone.predicted_ms * 0.2
    for i in range(10, 40):
        rec = record(alone, DECODE, alone.predicted_ms + search_ms, index=i)
        assert not rec.in_flight and not rec.finetune_launched
        policy.observe(replace(rec, plan_ms=search_ms))
    assert policy.margins.margin == pytest.approx(calm)
    for i in range(40, 70):  # decode alone really 20% slower than predicted: that is error
        policy.observe(record(alone, DECODE, alone.predicted_ms * 1.2, index=i))
    assert policy.margins.margin > calm + 0.1


def test_the_launch_overhead_prior_is_charged_until_a_launch_is_timed() -> None:
    with pytest.raises(ValueError, match="launch_overhead_prior_ms must be >= 0, got -1"):
        HarliConfig(launch_overhead_prior_ms=-1.0)
    policy = HarliPolicy(MODEL, HarliConfig(launch_overhead_prior_ms=3.0))
    assert policy.launch_overhead.ms == 3.0
    policy.launch_overhead.observe(predicted_ms=6.0, observed_ms=7.0)
    assert policy.launch_overhead.ms == pytest.approx(1.0)  # learnt from then on
    assert HarliPolicy(MODEL).launch_overhead.ms == 0.0


def test_host_config_caps_idle_slices_by_the_ttft_slo() -> None:
    from gpu_runtime.colocation.harli_config import (
        GPU_LAUNCH_OVERHEAD_PRIOR_MS,
        GPU_MAX_QUANTUM_MS,
        IDLE_SLICE_TTFT_SHARE,
        host_harli_config,
    )

    cpu = host_harli_config("cpu")
    assert cpu.launch_overhead_prior_ms == 0.0 and cpu.idle_slice_ms is None
    assert cpu.max_quantum_ms == HarliConfig().max_quantum_ms
    gpu = host_harli_config("cuda:1", ttft_slo_ms=80.0)
    assert gpu.launch_overhead_prior_ms == GPU_LAUNCH_OVERHEAD_PRIOR_MS
    assert gpu.max_quantum_ms == GPU_MAX_QUANTUM_MS < HarliConfig().max_quantum_ms
    assert gpu.idle_slice_ms == IDLE_SLICE_TTFT_SHARE * 80.0
    assert host_harli_config("cuda", ttft_slo_ms=1e4).idle_slice_ms == GPU_MAX_QUANTUM_MS
    with pytest.raises(ValueError, match="ttft_slo_ms must be > 0 or None, got -5"):
        host_harli_config("cuda", ttft_slo_ms=-5.0)
