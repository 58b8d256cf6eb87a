"""`CalibrationPolicy` gathers samples on every split, whatever the iteration budget."""

from __future__ import annotations

from dataclasses import replace

from gpu_runtime.colocation import DecodeSnapshot, validate_plan
from gpu_runtime.colocation.calibration import CalibrationPolicy
from gpu_runtime.colocation.types import InFlightQuantum

from .sim import JOB, TOTAL_SMS, context, record

OPTIONS = (32, 64, TOTAL_SMS)
BUSY = DecodeSnapshot.from_contexts([300, 500], prefill_tokens=64)


def test_solo_phase_spreads_samples_evenly_then_quanta_visit_every_split() -> None:
    policy = CalibrationPolicy(solo_target=4, beside_target=2, solo_s=100.0, block=1, settle=0)
    base = replace(context(BUSY, 1e9), decode_sms_options=OPTIONS)
    seen: list[int | None] = []
    for i in range(12):  # solo: 4 per split, round robin over the least sampled
        ctx = replace(base, now=float(i))
        plan = policy.plan(ctx)
        validate_plan(plan, ctx)
        assert not plan.launches
        seen.append(plan.decode_sms)
        policy.observe(record(plan, BUSY, 10.0, index=i))
    assert sorted(seen.count(d) for d in OPTIONS) == [4, 4, 4]
    launched: list[int | None] = []
    sizes: list[int] = []
    for i in range(6):  # beside: a launch on the least sampled split, then held while in flight
        plan = policy.plan(replace(base, now=20.0 + i))
        assert len(plan.launches) == 1
        launched.append(plan.decode_sms)
        sizes.append(plan.launches[0].max_tokens // JOB.max_seq_len)
        flight = InFlightQuantum("job", plan.launches[0].max_tokens, plan.decode_sms, 0.0)
        held = policy.plan(replace(base, now=20.5 + i, in_flight=flight))
        assert held.decode_sms == plan.decode_sms and not held.launches
        policy.observe(record(held, BUSY, 12.0, beside=256, beside_sms=plan.decode_sms))
    assert sorted(launched.count(d) for d in OPTIONS) == [2, 2, 2]
    assert set(sizes) == {1, 2}  # two quantum sizes: durations fit overhead + tokens / rate
    assert policy.done
    assert policy.counts()["32"] == {"solo": 4, "beside": 2, "quanta": 0}


def test_solo_phase_ends_on_time_even_if_targets_are_not_met() -> None:
    policy = CalibrationPolicy(solo_target=100, beside_target=1, solo_s=1.0)
    base = replace(context(BUSY, 1e9), decode_sms_options=OPTIONS)
    assert not policy.plan(replace(base, now=0.0)).launches
    assert not policy.plan(replace(base, now=0.5)).launches
    assert policy.plan(replace(base, now=1.5)).launches  # past solo_s: quanta start
    assert not policy.done
    idle = replace(base, now=2.0, decode=DecodeSnapshot(0, 0, 0))
    assert not policy.plan(idle).launches  # no decode work: a quantum would teach nothing


def test_decode_holds_a_split_for_a_block_and_the_first_iterations_after_a_move_do_not_count() -> (
    None
):
    policy = CalibrationPolicy(solo_target=3, beside_target=1, solo_s=100.0, block=4, settle=1)
    base = replace(context(BUSY, 1e9), decode_sms_options=OPTIONS)
    splits: list[int | None] = []
    notes: list[str] = []
    for i in range(12):
        plan = policy.plan(replace(base, now=float(i)))
        splits.append(plan.decode_sms)
        notes.append(plan.note)
        policy.observe(replace(record(plan, BUSY, 10.0, index=i), note=plan.note))
    assert [splits[i : i + 4].count(splits[i]) for i in (0, 4, 8)] == [4, 4, 4]
    assert len({splits[0], splits[4], splits[8]}) == 3  # each block on another split
    assert [n.endswith("settle") for n in notes[:4]] == [True, False, False, False]
    assert sorted(policy.solo[d] for d in OPTIONS) == [3, 3, 3]  # settle iterations not counted
