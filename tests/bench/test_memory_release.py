"""`bench/memory.py trace`'s phase `unified_release` on its own: which shape the budgeted policy
launches against the release plan (what it promises, when it drops the shared shapes first),
and the footprints the warm-up records when larger shapes have graph pools of their own."""

from __future__ import annotations

from types import SimpleNamespace

from bench.memory_sizing import QuantumSizing, ReleaseHooks, budgeted_policy
from bench.memory_trace import parse_phases
from bench.memory_warmup import shape_footprints

MIB = 1 << 20
SEQ = 100


def _ctx(budget: int, in_flight: object = None) -> SimpleNamespace:
    job = SimpleNamespace(job_id="ft", max_seq_len=SEQ)
    return SimpleNamespace(jobs=[job], in_flight=in_flight, finetune_budget_bytes=budget)


def _sizing() -> QuantumSizing:
    # 1 MiB per token, 100 tokens per example, nothing resident, safety 0.9. The warm-up
    # captured 1 and 2 examples into the shared pool (190 MiB held), then, the shared shapes
    # dropped, 4 into its own (300 MiB held).
    sizing = QuantumSizing(0, float(MIB), max_examples=4)
    for examples, held in ((1, 190 * MIB), (2, 190 * MIB), (4, 300 * MIB)):
        sizing.record_capture(examples, held)
    sizing.shared_rows = 2
    return sizing


def test_measured_shapes_fit_by_their_footprint_with_a_margin_to_capture_again() -> None:
    sizing = _sizing()
    assert sizing.measured_tokens(299 * MIB, SEQ) == 200
    assert sizing.measured_tokens(300 * MIB, SEQ, captured={4}) == 400
    assert sizing.measured_tokens(300 * MIB, SEQ, margin=1.1) == 200  # not held: 330 MiB
    assert sizing.measured_tokens(330 * MIB, SEQ, margin=1.1) == 400
    assert sizing.measured_tokens(300 * MIB, SEQ, captured={4}, refused={4}) == 200
    assert sizing.measured_tokens(10**12, SEQ, above=2, at_most=2) == 0
    assert sizing.measured_tokens(10**12, SEQ, at_most=2) == 200
    assert sizing.measured_tokens(150 * MIB, SEQ) == 0
    assert QuantumSizing(0, float(MIB), max_examples=4).measured_tokens(10**12, SEQ) == 0
    sizing.max_examples = 2
    assert sizing.measured_tokens(10**12, SEQ) == 200


def test_the_policy_runs_the_larger_shape_against_the_release_plan_alone() -> None:
    sizing = _sizing()
    release_plan = [400 * MIB]
    promised: list[int] = []
    prepared: list[int] = []
    refused: set[int] = set()
    captured = {1, 2}
    hooks = ReleaseHooks(lambda: release_plan[0], promised.append, lambda: refused, prepared.append)
    policy = budgeted_policy(sizing, None, lambda: captured, hooks)

    def launched(budget: int) -> int:
        (launch,) = policy.plan(_ctx(budget)).launches
        return int(launch.max_tokens)

    # The plan (peak term in) fits the shared shapes; the release plan covers 4's footprint
    # with the margin: the shared shapes are dropped first, the quantum promised the plan.
    assert launched(250 * MIB) == 400 and promised == [400 * MIB] and prepared == [4]
    captured = {4}  # captured now, alone; the plan is floored at what is held
    release_plan[0] = 310 * MIB  # decode grew, still within 4's footprint: no margin for held
    assert launched(300 * MIB) == 400 and prepared == [4] and promised[-1] == 310 * MIB
    captured = set()  # the memory side released it (release plan under 300 MiB)
    release_plan[0] = 320 * MIB  # back above 300 MiB but not by the margin: the shared shape
    assert launched(250 * MIB) == 200 and prepared == [4] and len(promised) == 2
    assert launched(150 * MIB) == 100  # 2's footprint does not fit: the estimate
    # The estimate never picks a shape above the shared pool's, nor does a refused capture.
    assert launched(10_000 * MIB) == 200
    refused.add(4)
    release_plan[0] = 10_000 * MIB
    assert launched(250 * MIB) == 200 and prepared == [4]
    # No hooks (every other phase): the plan alone, nothing promised, nothing dropped.
    plain = budgeted_policy(sizing, None, lambda: {1, 2, 4})
    (launch,) = plain.plan(_ctx(300 * MIB)).launches
    assert launch.max_tokens == 400 and len(promised) == 2
    # Nothing is planned while a quantum runs.
    assert policy.plan(_ctx(250 * MIB, in_flight=object())).launches == ()


def test_separate_shapes_keep_the_footprint_their_capture_left_held() -> None:
    held_after = {1: 120 * MIB, 2: 190 * MIB, 4: 300 * MIB}
    # One shared pool: what is held after the warm-up, for every shape.
    assert shape_footprints({1, 2, 4}, 480 * MIB, held_after, None) == {
        1: 480 * MIB,
        2: 480 * MIB,
        4: 480 * MIB,
    }
    # Shapes above 2 pooled on their own: the shared shapes at the shared pool's full size.
    assert shape_footprints({4}, 300 * MIB, held_after, 2) == {4: 300 * MIB}
    assert shape_footprints({1, 2, 4}, 480 * MIB, held_after, 2) == {
        1: 190 * MIB,
        2: 190 * MIB,
        4: 300 * MIB,
    }
    assert shape_footprints({1, 2}, 190 * MIB, {1: 120 * MIB, 2: 190 * MIB}, 2) == {
        1: 190 * MIB,
        2: 190 * MIB,
    }


def test_unified_release_is_a_phase() -> None:
    assert parse_phases("static_split,unified,unified_release") == [
        "static_split",
        "unified",
        "unified_release",
    ]
