"""Harli's launches: the extra cost of a launch iteration (learnt, charged as one gap of the
running requests) and launches whose micro-batch has no CUDA graph yet."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot, LaunchMode
from gpu_runtime.colocation.harli import HarliConfig, HarliPolicy
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.types import InFlightQuantum, IterationPlan, JobView
from gpu_runtime.predictor.schema import FinetuneQuantum

from .sim import JOB, OPTIONS, TOTAL_SMS, context, record

MODEL = AnalyticLatencyModel()


def _predicted(decode: DecodeSnapshot, decode_sms: int, mode: LaunchMode, tokens: int) -> float:
    share = decode_sms / TOTAL_SMS
    iteration = decode_iteration(decode, share)
    ft_share = 1.0 if share >= 1 else 1 - share
    quantum = FinetuneQuantum(tokens, JOB.seq_len, JOB.lora_rank, True, ft_share)
    return MODEL.predict_ms(iteration, quantum)


def test_launch_iterations_teach_their_extra_cost_to_the_coming_prediction() -> None:
    policy = HarliPolicy(MODEL, HarliConfig(allow_slice=False))
    decode = DecodeSnapshot.from_contexts([512] * 16)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 3.0
    first = policy.plan(context(decode, slo))
    assert first.launches and first.predicted_ms is not None
    assert policy.launch_overhead.ms == 0.0
    for _ in range(4):  # every launch iteration took 3 ms more than the model's prediction
        included = policy.launch_overhead.ms
        plan = policy.plan(context(decode, slo))
        assert plan.launches and plan.predicted_ms is not None
        policy.observe(record(plan, decode, plan.predicted_ms - included + 3.0))
        # ...and an iteration with the quantum in flight took what was predicted: not a launch
        flight = InFlightQuantum("job", plan.launches[0].max_tokens, plan.decode_sms, 0.0)
        in_flight = policy.plan(context(decode, slo, in_flight=flight))
        assert not in_flight.launches and in_flight.predicted_ms is not None
        policy.observe(record(in_flight, decode, in_flight.predicted_ms))
    assert policy.launch_overhead.ms == pytest.approx(3.0, abs=1e-9)
    again = policy.plan(context(decode, slo))
    assert again.launches and again.predicted_ms is not None and again.decode_sms is not None
    tokens = again.launches[0].max_tokens
    model_ms = _predicted(decode, again.decode_sms, LaunchMode.CONCURRENT, tokens)
    assert again.predicted_ms == pytest.approx(model_ms + 3.0)  # reported with the launch
    # Predictions that include the overhead no longer count it again.
    policy.observe(record(again, decode, again.predicted_ms))
    assert policy.launch_overhead.ms == pytest.approx(3.0, abs=1e-9)


def test_a_launch_costs_one_gap_of_the_running_requests_not_a_veto() -> None:
    from dataclasses import replace

    from gpu_runtime.colocation.types import RunningRequest

    decode = DecodeSnapshot.from_contexts([512] * 16)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 3.0
    # A launch gap far over the SLO.
    dear = HarliPolicy(MODEL, HarliConfig(allow_slice=False, launch_overhead_prior_ms=3 * slo))
    assert dear.plan(context(decode, slo)).launches  # alone it stops nothing
    # A request with one token left, whose mean takes that gap badly: decode alone keeps it,
    # the launch would not -> pause, and the plan says why; a cheap launch goes ahead.
    ending = RunningRequest(tokens=3, tpot_ms=slo * 0.9, remaining_tokens=1)
    ctx = replace(context(decode, slo), running=(ending,), worst_running_tpot_ms=ending.tpot_ms)
    held = dear.plan(ctx)
    assert held.paused and not held.launches and held.note == "request at risk"
    assert HarliPolicy(MODEL, HarliConfig(allow_slice=False)).plan(ctx).launches


def test_a_launch_without_a_graph_waits_for_room_in_the_running_requests() -> None:
    """A quantum whose micro-batch has no CUDA graph on its split's stream yet stalls the loop
    once (warm-up or capture): with nobody decoding, or requests with room for one long gap,
    it goes ahead (reported with its cost); with a request that cannot take the gap, harli
    takes a launch that replays instead, or pauses when every one would be cold."""
    from dataclasses import replace

    from gpu_runtime.colocation.types import RunningRequest

    decode = DecodeSnapshot.from_contexts([512] * 16)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 3.0
    config = HarliConfig(allow_slice=False, cold_launch_ms=300.0)
    warm = HarliPolicy(MODEL, config).plan(context(decode, slo))
    assert warm.launches and warm.predicted_ms is not None and warm.decode_sms is not None
    k = warm.launches[0].max_tokens // JOB.max_seq_len
    all_cold = frozenset((size, d) for size in (1, 2, 4, 8) for d in OPTIONS)
    one_cold = replace(JOB, cold_launches=frozenset({(k, warm.decode_sms)}))
    # No request to hold it back: a launch goes ahead though every one is cold, priced.
    plan = HarliPolicy(MODEL, config).plan(context(decode, slo, jobs=(replace_job(all_cold),)))
    assert plan.launches and plan.decode_sms is not None and plan.predicted_ms is not None
    tokens = plan.launches[0].max_tokens
    expected = _predicted(decode, plan.decode_sms, LaunchMode.CONCURRENT, tokens) + 300.0
    assert plan.predicted_ms == pytest.approx(expected)
    # With a warm choice at hand the cold one is not taken (its stall counts against it).
    assert HarliPolicy(MODEL, config).plan(context(decode, slo, jobs=(one_cold,))).launches
    # A request with 5 tokens to go and little room: 300 ms in one gap is too much for it.
    tight = RunningRequest(tokens=30, tpot_ms=slo * 0.9, remaining_tokens=5)

    def busy(job: JobView) -> IterationPlan:
        ctx = replace(
            context(decode, slo, jobs=(job,)), running=(tight,), worst_running_tpot_ms=0.9 * slo
        )
        return HarliPolicy(MODEL, config).plan(ctx)

    assert busy(JOB).launches  # all warm: it launches
    other = busy(one_cold)
    assert other.launches and (
        other.launches[0].max_tokens // JOB.max_seq_len,
        other.decode_sms,
    ) != (k, warm.decode_sms)
    assert other.predicted_ms is not None and other.predicted_ms < 300.0
    held = busy(replace(JOB, cold_launches=all_cold))
    assert held.paused and not held.launches and held.note == "request at risk"


def replace_job(cold: frozenset[tuple[int, int | None]]) -> JobView:
    from dataclasses import replace

    return replace(JOB, cold_launches=cold)


def test_a_cold_launch_does_not_teach_the_launch_overhead() -> None:
    decode = DecodeSnapshot.from_contexts([512] * 16)
    slo = MODEL.predict_ms(decode_iteration(decode, 1.0), None) * 3.0
    policy = HarliPolicy(MODEL, HarliConfig(allow_slice=False, cold_launch_ms=300.0))
    cold = replace_job(frozenset((size, d) for size in (1, 2, 4, 8) for d in OPTIONS))
    plan = policy.plan(context(decode, slo, jobs=(cold,)))
    assert plan.launches and plan.predicted_ms is not None
    policy.observe(record(plan, decode, plan.predicted_ms - 300.0 + 250.0))  # a 250 ms capture
    assert policy.launch_overhead.ms == 0.0
    warm = policy.plan(context(decode, slo))
    assert warm.launches and warm.predicted_ms is not None
    policy.observe(record(warm, decode, warm.predicted_ms + 2.0))
    assert policy.launch_overhead.ms == pytest.approx(2.0)


def test_chunk_steps_over_the_bound_on_a_split_are_priced_where_they_will_run() -> None:
    """While a quantum runs, a step carrying a prefill chunk that is over the bound on the held
    split moves to the whole device (the in-flight plan). The launch check prices it there
    too: some launches are on splits whose chunk steps, priced on the split, would break the
    bound; none breaks it as it will run."""
    decode = DecodeSnapshot.from_contexts([512] * 16)
    chunky = DecodeSnapshot.from_contexts([512] * 16, 256)
    solo = MODEL.predict_ms(decode_iteration(decode, 1.0), None)
    priced_on_split_over = 0
    for i in range(40):
        policy = HarliPolicy(MODEL, HarliConfig(allow_slice=False, replan_backoff=0))
        slo = solo * (1.2 + 0.05 * i)
        for _ in range(20):  # a chunk in every other step
            policy.plan(context(chunky, slo))
            policy.plan(context(decode, slo))
        plan = policy.plan(context(decode, slo))
        if not plan.launches or plan.decode_sms in (None, TOTAL_SMS):
            continue
        assert plan.margin is not None
        bound = slo * (1 - plan.margin)
        share = plan.decode_sms / TOTAL_SMS
        quantum = FinetuneQuantum(
            plan.launches[0].max_tokens, JOB.seq_len, JOB.lora_rank, True, 1 - share
        )
        assert policy.predictions.typical_ms(decode, share, quantum, bound) <= bound
        priced_on_split_over += policy.predictions.typical_ms(decode, share, quantum) > bound
    assert priced_on_split_over > 0


def test_idle_decode_runs_a_quantum_alone_on_the_whole_device_within_the_cap() -> None:
    """Nothing decodes: a quantum alone on the whole device (time slicing) harvests at the solo
    rate, and a request arriving meanwhile only waits for its first token, so it is chosen
    over one beside decode on a split, even under an SLO no split could keep, as long as its
    expected duration is within ``idle_slice_ms`` (default ``max_quantum_ms``)."""
    idle = DecodeSnapshot(0, 0, 0)
    config = HarliConfig(prior_quantum_overhead_ms=20.0, max_quantum_ms=150.0)
    policy = HarliPolicy(MODEL, config)
    plan = policy.plan(context(idle, 12.0))
    (launch,) = plan.launches
    assert launch.mode is LaunchMode.AFTER_DECODE and plan.decode_sms == TOTAL_SMS
    assert plan.predicted_ms is None and plan.note.startswith("decode idle: alone k=")
    assert launch.predicted_ms is not None and launch.predicted_ms <= 150.0
    # The biggest size whose expected duration fits the cap (a fixed cost per quantum).
    sizes = [k for k in config.quantum_examples if k * JOB.max_seq_len == launch.max_tokens]
    durations = {
        k: policy.durations.duration_ms(JOB, None, LaunchMode.AFTER_DECODE, 1.0, k * JOB.seq_len)
        for k in config.quantum_examples
    }
    assert sizes == [max(k for k, ms in durations.items() if ms <= 150.0)]
    # An SLO no split keeps for an arriving request: still a quantum alone.
    assert policy.plan(context(idle, 1.0)).launches[0].mode is LaunchMode.AFTER_DECODE
    # A cap below the smallest quantum, or 0: only quanta beside decode, as before.
    for cap in (min(durations.values()) / 2, 0.0):
        beside = HarliPolicy(MODEL, replace(config, idle_slice_ms=cap))
        assert beside.plan(context(idle, 12.0)).launches[0].mode is LaunchMode.CONCURRENT
        assert beside.plan(context(idle, 1.0)).launches == ()
    with pytest.raises(ValueError, match="idle_slice_ms"):
        HarliConfig(idle_slice_ms=-1.0)
    # Requests waiting for a step (none taken up yet): nothing alone that would hold them up.
    waiting = DecodeSnapshot(0, 0, 0, waiting_requests=2)
    assert waiting.is_idle
    assert policy.plan(context(waiting, 12.0)).launches[0].mode is LaunchMode.CONCURRENT
    # Busy decode: no idle slice (the usual choices).
    busy = policy.plan(context(DecodeSnapshot.from_contexts([512] * 8), 12.0))
    assert not busy.note.startswith("decode idle")
