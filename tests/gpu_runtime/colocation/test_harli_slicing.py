"""Harli's layer-sliced quanta on a fake clock: they fill the slack that whole quanta cannot,
never break the bound, continue the micro-batch in progress, and learn what slices cost."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot, LaunchMode
from gpu_runtime.colocation.harli import HarliConfig, HarliPolicy
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.slicing import SliceState
from gpu_runtime.colocation.types import IterationPlan, QuantumReport
from gpu_runtime.predictor.schema import FinetuneQuantum

from .sim import JOB, TOTAL_SMS, context, record

MODEL = AnalyticLatencyModel()
LAYERS = 32
SLICED_JOB = replace(JOB, layers=LAYERS, tokens_per_s_solo=15_000.0)
# Whole quanta cost 120 ms of fixed work (the H200's figure today), far above any slack.
SLOW = HarliConfig(prior_quantum_overhead_ms=120.0, allow_shared=False)
DECODE = DecodeSnapshot.from_contexts([512] * 16)
SOLO = MODEL.predict_ms(decode_iteration(DECODE, 1.0), None)


def _after_decode_only(policy: HarliPolicy, slo: float) -> IterationPlan:
    ctx = context(DECODE, slo, jobs=(SLICED_JOB,), spatial=False)
    return policy.plan(ctx)


def _report(plan: IterationPlan, passes: int, ms: float, done: bool) -> QuantumReport:
    (launch,) = plan.launches
    return QuantumReport(
        "job",
        launch.max_tokens if done else 0,
        ms,
        launch.mode,
        plan.decode_sms,
        layer_passes=passes,
        micro_batch_done=done,
    )


def test_slices_fill_the_slack_whole_quanta_cannot() -> None:
    slo = SOLO * 2.0
    whole_only = HarliPolicy(MODEL, replace(SLOW, layer_slices=()))
    assert _after_decode_only(whole_only, slo).paused  # 120 ms never fits a ~6 ms slack
    policy = HarliPolicy(MODEL, SLOW)
    plan = _after_decode_only(policy, slo)
    (launch,) = plan.launches
    assert launch.mode is LaunchMode.AFTER_DECODE and launch.max_layers is not None
    assert plan.margin is not None and plan.predicted_ms is not None
    assert plan.predicted_ms <= slo * (1 - plan.margin)
    assert launch.predicted_ms is not None
    assert plan.predicted_ms == pytest.approx(SOLO + launch.predicted_ms)


def test_pauses_when_not_even_one_layer_fits() -> None:
    policy = HarliPolicy(MODEL, SLOW)
    plan = _after_decode_only(policy, SOLO * 1.01)
    assert plan.paused and not plan.launches and "no safe choice" in plan.note


def test_a_micro_batch_in_progress_continues_in_slices_to_its_end() -> None:
    policy = HarliPolicy(MODEL, SLOW)
    slo = SOLO * 2.0
    passes = 0
    examples = set()
    for _ in range(400):
        plan = _after_decode_only(policy, slo)
        assert plan.launches, plan.note
        (launch,) = plan.launches
        assert launch.max_layers is not None  # never a whole quantum while one is open
        examples.add(launch.max_tokens)
        state = policy.feedback.slices["job"]
        forward, backward = state.passes_for(launch.max_layers)
        ran = forward + backward
        passes += ran
        done = passes == 2 * LAYERS
        report = _report(plan, ran, launch.predicted_ms or 1.0, done)
        policy.observe(record(plan, DECODE, SOLO + report.duration_ms, quanta=(report,)))
        if done:
            assert not state.active
            break
        assert state.passes_done == passes
    else:
        pytest.fail("the micro-batch never completed")
    assert len(examples) == 1  # one micro-batch, one size


def test_slice_costs_learn_from_slow_slices_and_shrink_the_next_slice() -> None:
    policy = HarliPolicy(MODEL, SLOW)
    slo = SOLO * 2.0
    first = _after_decode_only(policy, slo)
    (launch,) = first.launches
    assert launch.max_layers is not None and launch.predicted_ms is not None
    state = policy.feedback.slices["job"]
    ran = sum(state.passes_for(launch.max_layers))
    for _ in range(3):  # every slice takes three times its estimate
        slow = _report(first, ran, 3 * launch.predicted_ms, False)
        policy.feedback.slice_launches["job"] = (None, LaunchMode.AFTER_DECODE, launch.predicted_ms)
        policy.observe(record(first, DECODE, SOLO + slow.duration_ms, quanta=(slow,)))
    assert policy.slice_costs.correction(None, LaunchMode.AFTER_DECODE) == pytest.approx(3.0)
    second = _after_decode_only(policy, slo)
    if second.launches:
        (after,) = second.launches
        assert after.max_layers is not None and after.predicted_ms is not None
        assert second.predicted_ms is not None and second.margin is not None
        assert second.predicted_ms <= slo * (1 - second.margin)
    else:
        assert second.paused


def test_backward_slices_run_whole_forward_slices() -> None:
    state = SliceState(layers=4)
    state.start("job", 1, 256)
    for width in (1, 3):
        assert state.passes_for(width) == (width, 0)
        state.observe(
            QuantumReport(
                "job",
                0,
                1.0,
                LaunchMode.AFTER_DECODE,
                None,
                layer_passes=width,
                micro_batch_done=False,
            )
        )
    assert state.passes_for(1) == (0, 3)  # the top forward slice was 3 layers wide
    assert state.passes_for(4) == (0, 4)
    state.observe(
        QuantumReport(
            "job", 0, 1.0, LaunchMode.AFTER_DECODE, None, layer_passes=3, micro_batch_done=False
        )
    )
    assert state.passes_for(8) == (0, 1) and state.passes_left == 1
    state.observe(QuantumReport("job", 256, 1.0, LaunchMode.AFTER_DECODE, None, layer_passes=1))
    assert not state.active


@settings(max_examples=120, deadline=None)
@given(
    batch=st.integers(1, 256),
    context_mean=st.integers(16, 4096),
    prefill=st.sampled_from([0, 0, 128, 1024]),
    slo_factor=st.floats(1.0, 3.0),
    spatial=st.booleans(),
)
def test_never_picks_a_sliced_choice_predicted_to_break_the_bound(
    batch: int, context_mean: int, prefill: int, slo_factor: float, spatial: bool
) -> None:
    policy = HarliPolicy(MODEL, HarliConfig(prior_quantum_overhead_ms=120.0))
    decode = DecodeSnapshot.from_contexts([context_mean] * batch, prefill)
    solo = MODEL.predict_ms(decode_iteration(decode, 1.0), None)
    slo = solo * slo_factor
    plan = policy.plan(context(decode, slo, jobs=(SLICED_JOB,), spatial=spatial))
    assert plan.margin is not None
    if not plan.launches:
        assert plan.paused and plan.decode_sms == (TOTAL_SMS if spatial else None)
        return
    (launch,) = plan.launches
    assert plan.predicted_ms is not None
    if launch.mode is LaunchMode.AFTER_DECODE:
        assert plan.predicted_ms <= slo * (1 - plan.margin)
    else:
        assert plan.predicted_ms <= slo
        share = (plan.decode_sms or TOTAL_SMS) / TOTAL_SMS
        ft_share = 1.0 if share >= 1 else 1.0 - share
        quantum = FinetuneQuantum(launch.max_tokens, JOB.seq_len, JOB.lora_rank, True, ft_share)
        bound = slo * (1 - plan.margin)
        assert policy.predictions.typical_ms(decode, share, quantum, bound) <= bound


def test_measured_slice_costs_pick_the_widest_slice_whose_backward_fits() -> None:
    """Per call 5 ms, 1 ms per forward and 2.5 ms per backward layer; 11 ms of slack: a 6-layer
    forward call would fit (11 ms) but its backward call (20 ms) would not; 2 layers (7.5 ms
    back) is the widest that keeps both within the slack."""
    config = replace(
        SLOW, slice_call_ms=5.0, slice_forward_layer_ms=1.0, slice_backward_layer_ms=2.5
    )
    policy = HarliPolicy(MODEL, config)
    slo = (SOLO + 11.0) / (1 - config.initial_margin)
    plan = _after_decode_only(policy, slo)
    (launch,) = plan.launches
    assert launch.max_layers == 2
    assert launch.predicted_ms == pytest.approx(5.0 + 2 * 1.0)


def test_slices_beside_decode_are_never_wider_than_the_configured_widths() -> None:
    """A micro-batch in progress finishes beside decode in slices of at most 16 layers, not
    in one eager call over every remaining pass."""
    policy = HarliPolicy(MODEL, SLOW)
    plan = _after_decode_only(policy, SOLO * 2.0)
    (launch,) = plan.launches
    assert launch.max_layers is not None
    state = policy.feedback.slices["job"]
    ran = sum(state.passes_for(launch.max_layers))
    policy.observe(record(plan, DECODE, SOLO, quanta=(_report(plan, ran, 1.0, False),)))
    assert state.passes_left > 16
    idle = DecodeSnapshot(0, 0, 0)  # after-decode slices need decode work: only spatial ones
    beside = policy.plan(context(idle, SOLO * 2.0, jobs=(SLICED_JOB,)))
    assert beside.launches, beside.note
    (slice_,) = beside.launches
    assert slice_.mode is LaunchMode.CONCURRENT
    assert slice_.max_layers is not None and slice_.max_layers <= 16
