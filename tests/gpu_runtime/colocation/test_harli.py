"""Harli's plans on a fake clock with a known analytic predictor: never a choice predicted to
break the SLO (the throughput-maximising split among the safe ones), a pause when nothing is
safe and a backoff from planning while that lasts, the finetune memory budget, a quantum in
flight (no new launch; decode holds its split until that is predicted over the bound), idle
decode, no partitioner, and running requests projected to their end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot, LaunchMode
from gpu_runtime.colocation.harli import HarliConfig, HarliPolicy
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.types import InFlightQuantum, IterationPlan
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum

from .sim import JOB, OPTIONS, TOTAL_SMS, context, record

MODEL = AnalyticLatencyModel()


def _predicted(decode: DecodeSnapshot, decode_sms: int, mode: LaunchMode, tokens: int) -> float:
    share = decode_sms / TOTAL_SMS
    iteration = decode_iteration(decode, share)
    if mode is LaunchMode.AFTER_DECODE:
        return MODEL.predict_ms(iteration, None)
    ft_share = 1.0 if share >= 1 else 1 - share
    quantum = FinetuneQuantum(tokens, JOB.seq_len, JOB.lora_rank, True, ft_share)
    return MODEL.predict_ms(iteration, quantum)


def _typical(
    policy: HarliPolicy, decode: DecodeSnapshot, decode_sms: int, tokens: int, bound: float
) -> float:
    """What the policy expects of the iterations while a quantum launched now runs (chunk
    steps over ``bound`` on the split moved to the whole device, as in flight)."""
    share = decode_sms / TOTAL_SMS
    ft_share = 1.0 if share >= 1 else 1 - share
    quantum = FinetuneQuantum(tokens, JOB.seq_len, JOB.lora_rank, True, ft_share)
    return policy.predictions.typical_ms(decode, share, quantum, bound)


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 256),
    context_mean=st.integers(16, 4096),
    prefill=st.sampled_from([0, 0, 128, 1024]),
    slo_ms=st.floats(4.0, 60.0),
)
def test_never_picks_a_choice_predicted_to_break_the_slo(
    batch: int, context_mean: int, prefill: int, slo_ms: float
) -> None:
    policy = HarliPolicy(MODEL)
    decode = DecodeSnapshot.from_contexts([context_mean] * batch, prefill)
    plan = policy.plan(context(decode, slo_ms))
    assert plan.margin is not None
    bound = slo_ms * (1 - plan.margin)
    if not plan.launches:
        assert plan.paused and plan.decode_sms == TOTAL_SMS
        # Paused only when truly nothing is safe: the best split with the smallest quantum.
        assert all(
            _predicted(decode, d, LaunchMode.CONCURRENT, JOB.max_seq_len) > bound for d in OPTIONS
        )
        return
    (launch,) = plan.launches
    assert plan.decode_sms is not None and plan.predicted_ms is not None

    def safe(d: int, tokens: int) -> bool:
        return (
            _typical(policy, decode, d, tokens, bound) <= bound
            and _predicted(decode, d, LaunchMode.CONCURRENT, tokens) <= slo_ms
        )

    if launch.mode is LaunchMode.AFTER_DECODE:
        assert plan.predicted_ms <= bound
        return
    # The typical iteration under the held split within the bound, this one within the SLO.
    assert plan.predicted_ms <= slo_ms
    assert safe(plan.decode_sms, launch.max_tokens)
    if plan.decode_sms < TOTAL_SMS:
        # Throughput-maximising: no smaller decode share would have been safe.
        assert not any(safe(d, JOB.max_seq_len) for d in OPTIONS if d < plan.decode_sms)


def test_pauses_when_nothing_is_safe_and_resumes_when_it_is() -> None:
    policy = HarliPolicy(MODEL)
    decode = DecodeSnapshot.from_contexts([1024] * 64)
    solo = MODEL.predict_ms(decode_iteration(decode, 1.0), None)
    tight = policy.plan(context(decode, slo_ms=solo * 1.01))
    assert tight.paused and not tight.launches and tight.decode_sms == TOTAL_SMS
    assert "no safe choice" in tight.note
    loose = policy.plan(context(decode, slo_ms=solo * 3))
    assert not loose.paused and loose.launches
    assert policy.pauses == 1


def test_memory_budget_limits_the_quantum_and_pauses_below_one_example() -> None:
    policy = HarliPolicy(
        MODEL, HarliConfig(max_quantum_ms=1e9, allow_slice=False, allow_shared=False)
    )
    decode = DecodeSnapshot.from_contexts([256] * 8)
    job = JOB.__class__("job", 256, 256, 16, bytes_per_token=1000.0)
    roomy = policy.plan(context(decode, 100.0, jobs=(job,), budget=10**9))
    assert roomy.launches[0].max_tokens == max(HarliConfig().quantum_examples) * 256
    small = policy.plan(context(decode, 100.0, jobs=(job,), budget=2 * 256 * 1000))
    assert small.launches[0].max_tokens <= 2 * 256
    none = policy.plan(context(decode, 100.0, jobs=(job,), budget=100 * 1000))
    assert none.paused and not none.launches and "memory" in none.note


def test_in_flight_quantum_keeps_its_split_and_blocks_new_launches() -> None:
    policy = HarliPolicy(MODEL)
    decode = DecodeSnapshot.from_contexts([512] * 16)
    flight = InFlightQuantum("job", 512, 64, 0.0)
    plan = policy.plan(context(decode, 100.0, in_flight=flight))
    assert plan.launches == () and plan.decode_sms == 64 and "in flight" in plan.note


def test_idle_decode_plans_for_a_request_arriving_during_the_quantum() -> None:
    """Without idle time slices (``idle_slice_ms=0``), an idle quantum runs beside decode on
    the smallest split safe for a request that may arrive while it runs."""
    policy = HarliPolicy(MODEL, HarliConfig(idle_slice_ms=0))
    idle = DecodeSnapshot(0, 0, 0)
    roomy = policy.plan(context(idle, 1e4))
    assert roomy.decode_sms == OPTIONS[0] and roomy.launches
    assert roomy.launches[0].mode is LaunchMode.CONCURRENT
    plan = policy.plan(context(idle, 12.0))
    assert plan.margin is not None and plan.decode_sms is not None and plan.launches
    probe = DecodeSnapshot.from_contexts([HarliConfig().idle_probe_context_tokens])
    bound = 12.0 * (1 - plan.margin)
    tokens = plan.launches[0].max_tokens
    assert _predicted(probe, plan.decode_sms, LaunchMode.CONCURRENT, tokens) <= bound
    smaller = [d for d in OPTIONS if d < plan.decode_sms]
    assert smaller and all(
        _predicted(probe, d, LaunchMode.CONCURRENT, JOB.max_seq_len) > bound for d in smaller
    )
    assert policy.pauses == 0
    nothing = policy.plan(context(idle, 1.0))
    assert nothing.launches == () and not nothing.paused


def test_without_a_partitioner_only_shared_or_sliced_choices_exist() -> None:
    policy = HarliPolicy(MODEL)
    decode = DecodeSnapshot.from_contexts([128] * 4)
    plan = policy.plan(context(decode, 200.0, spatial=False))
    assert plan.decode_sms is None and plan.launches
    assert plan.predicted_ms is not None and plan.margin is not None
    assert plan.predicted_ms <= 200.0 * (1 - plan.margin)


def test_running_requests_are_projected_to_their_end() -> None:
    from dataclasses import replace

    from gpu_runtime.colocation.types import RunningRequest

    policy = HarliPolicy(MODEL, HarliConfig(allow_slice=False, replan_backoff=0))
    decode = DecodeSnapshot.from_contexts([512] * 16)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 2.0
    base = context(decode, slo)
    free = policy.plan(base)
    assert free.launches and free.margin is not None

    def plan_with(*running: RunningRequest, policy: HarliPolicy = policy) -> IterationPlan:
        return policy.plan(
            replace(
                base,
                running=running,
                worst_running_tpot_ms=max(r.tpot_ms for r in running),
            )
        )

    # Over the SLO so far, 20 tokens left: decode alone brings it back under the SLO, any
    # co-run iteration (its prediction inflated by the margin) keeps it over -> pause, and the
    # plan says why.
    rescuable = RunningRequest(tokens=100, tpot_ms=slo * 1.1, remaining_tokens=20)
    alone = policy.predictions.typical_ms(decode, 1.0, None)
    assert rescuable.final_tpot_ms(alone, 64) <= slo
    paused = plan_with(rescuable)
    assert paused.paused and not paused.launches and paused.note == "request at risk"
    # Its gaps so far are known, only the remaining ones carry the margin: a request a little
    # over the SLO is kept by a split that leaves decode more SMs, not by a pause.
    nearly = RunningRequest(tokens=100, tpot_ms=slo * 1.02, remaining_tokens=20)
    kept = plan_with(nearly)
    assert kept.launches and kept.decode_sms is not None and free.decode_sms is not None
    assert kept.decode_sms > free.decode_sms
    assert kept.predicted_ms is not None and kept.margin is not None
    assert nearly.final_tpot_ms(kept.predicted_ms / (1 - kept.margin), 64) <= slo
    # The same request with many tokens left: co-run iterations far under the SLO pull its mean
    # down anyway, so finetuning goes on.
    recovering = RunningRequest(tokens=100, tpot_ms=slo * 1.02, remaining_tokens=400)
    assert plan_with(recovering).launches
    # Lost whatever happens (decode alone cannot bring it under the SLO): it holds nothing back.
    lost = RunningRequest(tokens=200, tpot_ms=slo * 3, remaining_tokens=5)
    assert lost.final_tpot_ms(alone, 64) > slo
    assert plan_with(lost).launches
    # A limit-less request is projected over `unknown_remaining_tokens` tokens.
    unknown = RunningRequest(tokens=100, tpot_ms=slo * 1.045, remaining_tokens=None)
    expected = unknown.final_tpot_ms(alone, policy.config.unknown_remaining_tokens)
    assert expected == pytest.approx((99 * slo * 1.045 + 64 * alone) / (99 + 64), rel=1e-12)
    long = HarliPolicy(MODEL, HarliConfig(allow_slice=False, unknown_remaining_tokens=400))
    assert plan_with(unknown, policy=long).launches
    short = HarliPolicy(MODEL, HarliConfig(allow_slice=False, unknown_remaining_tokens=10))
    assert plan_with(unknown, policy=short).note == "request at risk"


def test_after_a_burst_running_requests_are_projected_with_its_chunk_steps() -> None:
    """A lull after a burst: the recent chunk share is ~0, so the typical iteration under a
    quantum looks like pure decode; requests near the SLO are projected to their end with the
    remembered share, so harli launches smaller quanta for them, or none, where a policy
    without memory launches bigger ones."""
    from dataclasses import replace

    from gpu_runtime.colocation.types import RunningRequest

    decode = DecodeSnapshot.from_contexts([512] * 16)
    burst = DecodeSnapshot.from_contexts([512] * 16, prefill_tokens=400)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 2.0

    def warmed(memory: float | None) -> HarliPolicy:
        policy = HarliPolicy(MODEL, HarliConfig(allow_slice=False, prefill_memory_smoothing=memory))
        for _ in range(150):  # the burst: every other step carries a chunk
            policy.plan(context(burst, slo))
            policy.plan(context(decode, slo))
        for _ in range(100):  # the lull
            policy.plan(context(decode, slo))
        return policy

    def launched(plan: IterationPlan) -> int:
        return sum(launch.max_tokens for launch in plan.launches)

    smaller = []
    for tenths in range(50, 140, 5):  # requests ever closer to the SLO, then over it
        late = RunningRequest(tokens=60, tpot_ms=slo * tenths / 100, remaining_tokens=200)
        ctx = replace(context(decode, slo), running=(late,), worst_running_tpot_ms=late.tpot_ms)
        forgetful, remembering = warmed(None).plan(ctx), warmed(0.005).plan(ctx)
        assert launched(remembering) <= launched(forgetful)  # memory only ever holds back
        if launched(remembering) < launched(forgetful):
            smaller.append(tenths)
    assert smaller  # for some requests the memory alone holds back


def test_in_flight_decode_holds_the_launch_split_until_it_is_predicted_over_the_bound() -> None:
    """Decode stays on the split the quantum was launched beside although the whole device
    (sharing the quantum's SMs) is predicted faster; it moves there only when the held split
    is predicted over the bound and the whole device is faster."""
    model = AnalyticLatencyModel(shared_interference=0.02)  # sharing barely slows decode here
    policy = HarliPolicy(model, HarliConfig(initial_margin=0.1))
    decode = DecodeSnapshot.from_contexts([512] * 16)
    flight = InFlightQuantum("job", 512, 64, 0.0)
    quantum = FinetuneQuantum(512, JOB.seq_len, JOB.lora_rank, True, 1 - 64 / TOTAL_SMS)
    on_split = model.predict_ms(decode_iteration(decode, 64 / TOTAL_SMS), quantum)
    on_device = model.predict_ms(decode_iteration(decode, 1.0), quantum)
    assert on_device < on_split  # the whole device is faster for decode
    held = policy.plan(context(decode, on_split * 1.5, in_flight=flight))
    assert held.decode_sms == 64 and held.predicted_ms == pytest.approx(on_split)
    assert held.note == "quantum in flight" and not held.launches
    # The held split over the bound (SLO x 0.9), the whole device under it: decode moves.
    tight = on_split * 1.05
    moved = policy.plan(context(decode, tight, in_flight=flight))
    assert moved.decode_sms == TOTAL_SMS and moved.predicted_ms == pytest.approx(on_device)
    assert "moved" in moved.note and not moved.launches
    # A quantum launched on the whole device keeps decode there.
    shared = InFlightQuantum("job", 512, TOTAL_SMS, 0.0)
    assert policy.plan(context(decode, tight, in_flight=shared)).decode_sms == TOTAL_SMS


class _CountingModel(AnalyticLatencyModel):
    calls = 0

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        type(self).calls += 1
        return super().predict_ms(iteration, quantum)


def test_after_plans_that_found_nothing_safe_it_pauses_without_predicting_for_a_while() -> None:
    """Under overload every plan finds nothing: the next min(n, replan_backoff) iterations pause
    without asking the model; a request finishing (a smaller batch) ends the backoff at once."""
    from gpu_runtime.colocation.corrected import CorrectedLatencyModel

    model = _CountingModel()
    policy = HarliPolicy(CorrectedLatencyModel(model), HarliConfig(replan_backoff=3))
    decode = DecodeSnapshot.from_contexts([1024] * 64)
    tight = context(decode, model.predict_ms(decode_iteration(decode, 1.0), None) * 1.01)
    notes = []
    for i in range(12):
        before = _CountingModel.calls
        plan = policy.plan(tight)
        assert plan.paused and not plan.launches and plan.decode_sms == TOTAL_SMS
        policy.observe(record(plan, decode, tight.tpot_slo_ms * 0.9, index=i))
        asked = _CountingModel.calls > before  # planning or learning from the iteration
        assert asked == (plan.note != "backing off")
        notes.append("plan" if asked else "skip")
    # 1 skip after the first failed plan, 2 after the second, then 3 at most.
    assert (
        notes
        == ["plan", "skip", "plan", "skip", "skip", "plan"] + ["skip"] * 3 + ["plan"] + ["skip"] * 2
    )
    assert policy.pauses == 12
    smaller = DecodeSnapshot.from_contexts([1024] * 63)  # a request finished: plan at once
    before = _CountingModel.calls
    assert policy.plan(context(smaller, tight.tpot_slo_ms)).note != "backing off"
    assert _CountingModel.calls > before
    # A plan that finds a safe choice ends the streak: no backoff after it.
    loose = context(smaller, tight.tpot_slo_ms * 3)
    assert policy.plan(loose).launches and policy.plan(loose).launches
