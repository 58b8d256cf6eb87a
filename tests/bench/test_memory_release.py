"""`python -m bench.memory trace`'s phase `unified_release` on its own: which shape the budgeted
policy launches against the release plan (what it promises, when it drops the shared shapes first),
and the footprints the warm-up records when larger shapes have graph pools of their own."""

from __future__ import annotations

from types import SimpleNamespace

from bench.memory.sizing import QuantumSizing, ReleaseHooks, budgeted_policy
from bench.memory.trace import parse_phases
from bench.memory.warmup import shape_footprints
from gpu_runtime.finetune.quantum_fit import QuantumShape

ONE, TWO, FOUR = QuantumShape(1), QuantumShape(2), QuantumShape(4)

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
    for shape, held in ((ONE, 190 * MIB), (TWO, 190 * MIB), (FOUR, 300 * MIB)):
        sizing.record_capture(shape, held)
    sizing.shared = {ONE, TWO}
    return sizing


def test_measured_shapes_fit_by_their_footprint_with_a_margin_to_capture_again() -> None:
    sizing = _sizing()
    every = {ONE, TWO, FOUR}
    assert sizing.choose_measured(299 * MIB, every) == TWO
    assert sizing.choose_measured(300 * MIB, every, captured={FOUR}) == FOUR
    assert sizing.choose_measured(300 * MIB, every, margin=1.1) == TWO  # not held: 330 MiB
    assert sizing.choose_measured(330 * MIB, every, margin=1.1) == FOUR
    assert sizing.choose_measured(300 * MIB, every, captured={FOUR}, refused={FOUR}) == TWO
    assert sizing.choose_measured(10**12, {FOUR} - {FOUR}) is None
    assert sizing.choose_measured(10**12, {ONE, TWO}) == TWO
    assert sizing.choose_measured(150 * MIB, every) is None
    assert QuantumSizing(0, float(MIB), max_examples=4).choose_measured(10**12, every) is None
    sizing.max_examples = 2
    assert sizing.choose_measured(10**12, every) == TWO


def test_the_policy_runs_the_larger_shape_against_the_release_plan_alone() -> None:
    sizing = _sizing()
    release_plan = [400 * MIB]
    promised: list[int] = []
    prepared: list[QuantumShape] = []
    refused: set[QuantumShape] = set()
    captured = {ONE, TWO}
    hooks = ReleaseHooks(lambda: release_plan[0], promised.append, lambda: refused, prepared.append)
    policy = budgeted_policy(sizing, None, lambda: captured, hooks)

    def launched(budget: int) -> int:
        (launch,) = policy.plan(_ctx(budget)).launches
        return int(launch.max_tokens)

    # The plan (peak term in) fits the shared shapes; the release plan covers 4's footprint
    # with the margin: the shared shapes are dropped first, the quantum promised the plan.
    assert launched(250 * MIB) == 400 and promised == [400 * MIB] and prepared == [FOUR]
    captured = {FOUR}  # captured now, alone; the plan is floored at what is held
    release_plan[0] = 310 * MIB  # decode grew, still within 4's footprint: no margin for held
    assert launched(300 * MIB) == 400 and prepared == [FOUR] and promised[-1] == 310 * MIB
    captured = set()  # the memory side released it (release plan under 300 MiB)
    release_plan[0] = 320 * MIB  # back above 300 MiB but not by the margin: the shared shape
    assert launched(250 * MIB) == 200 and prepared == [FOUR] and len(promised) == 2
    assert launched(150 * MIB) == 100  # 2's footprint does not fit: the estimate
    # The estimate never picks a shape above the shared pool's, nor does a refused capture.
    assert launched(10_000 * MIB) == 200
    refused.add(FOUR)
    release_plan[0] = 10_000 * MIB
    assert launched(250 * MIB) == 200 and prepared == [FOUR]
    assert dict(sizing.launched) == {"4": 2, "2": 3, "1": 1}
    # No hooks (every other phase): the plan alone, nothing promised, nothing dropped.
    plain = budgeted_policy(sizing, None, lambda: {ONE, TWO, FOUR})
    (launch,) = plain.plan(_ctx(300 * MIB)).launches
    assert launch.max_tokens == 400 and len(promised) == 2
    # Nothing is planned while a quantum runs.
    assert policy.plan(_ctx(250 * MIB, in_flight=object())).launches == ()


def test_the_shape_without_recomputation_runs_against_the_release_plan() -> None:
    """Long examples: one example without recomputation (pooled on its own) runs while the
    release plan covers it; beside decode's peak the shared pool's recomputing shapes run.
    Every launch tells `on_launch` its shape (the phase sets the trainer's mode from it)."""
    one_r, two_r = QuantumShape(1, recompute=True), QuantumShape(2, recompute=True)
    sizing = QuantumSizing(40 * MIB, float(MIB), max_examples=2, recompute_bytes_per_token=MIB / 4)
    for shape, held in ((one_r, 60 * MIB), (two_r, 80 * MIB), (ONE, 150 * MIB)):
        sizing.record_capture(shape, held)
    sizing.shared = {one_r, two_r}
    release_plan = [200 * MIB]
    promised: list[int] = []
    prepared: list[QuantumShape] = []
    hooks = ReleaseHooks(lambda: release_plan[0], promised.append, set, prepared.append)
    captured = {one_r, two_r}
    modes: list[QuantumShape] = []
    policy = budgeted_policy(sizing, None, lambda: captured, hooks, modes.append)

    def launched(budget: int) -> QuantumShape:
        (launch,) = policy.plan(_ctx(budget)).launches
        assert launch.max_tokens == modes[-1].examples * SEQ
        return modes[-1]

    assert launched(90 * MIB) == ONE and prepared == [ONE] and promised == [200 * MIB]
    captured = {ONE}
    release_plan[0] = 150 * MIB  # decode grew to the footprint: still held, still runs
    assert launched(150 * MIB) == ONE
    captured = set()  # released: back to recomputation, by its measured footprint
    release_plan[0] = 160 * MIB  # within the margin to capture it again
    assert launched(90 * MIB) == two_r and prepared == [ONE]
    assert launched(70 * MIB) == one_r
    assert [shape.recompute for shape in modes] == [False, False, True, True]
    assert dict(sizing.launched) == {"1": 2, "2r": 1, "1r": 1}


def test_separate_shapes_keep_the_footprint_their_capture_left_held() -> None:
    held_after = {ONE: 120 * MIB, TWO: 190 * MIB, FOUR: 300 * MIB}
    # One shared pool: what is held after the warm-up, for every shape.
    assert shape_footprints({ONE, TWO, FOUR}, 480 * MIB, held_after, None) == {
        ONE: 480 * MIB,
        TWO: 480 * MIB,
        FOUR: 480 * MIB,
    }
    # Shapes other than 1 and 2 pooled on their own: the shared ones at the shared pool's size.
    shared = {ONE, TWO}
    assert shape_footprints({FOUR}, 300 * MIB, held_after, shared) == {FOUR: 300 * MIB}
    assert shape_footprints({ONE, TWO, FOUR}, 480 * MIB, held_after, shared) == {
        ONE: 190 * MIB,
        TWO: 190 * MIB,
        FOUR: 300 * MIB,
    }
    small = {ONE: 120 * MIB, TWO: 190 * MIB}
    assert shape_footprints({ONE, TWO}, 190 * MIB, small, shared) == {
        ONE: 190 * MIB,
        TWO: 190 * MIB,
    }


def test_unified_release_is_a_phase() -> None:
    assert parse_phases("static_split,unified,unified_release") == [
        "static_split",
        "unified",
        "unified_release",
    ]
