"""Sizing a quantum to a budget: estimates and measured footprints per mode, the choice order
(largest without recomputation, else with it, else nothing) and the warm-up's plan."""

from __future__ import annotations

import pytest

from gpu_runtime.finetune.quantum_fit import QuantumFit, QuantumShape, best

MIB = 1 << 20
SEQ = 100


def _fit(**overrides: object) -> QuantumFit:
    # 100 MiB resident; 1 MiB per token without recomputation, 0.25 with; safety 0.9, so one
    # example of 100 tokens is estimated at 100 + 111 = 211 MiB without, 100 + 27 with
    settings: dict[str, object] = {
        "resident_bytes": 100 * MIB,
        "bytes_per_token": float(MIB),
        "max_examples": 4,
        "recompute_bytes_per_token": MIB / 4,
    }
    settings.update(overrides)
    return QuantumFit(**settings)  # type: ignore[arg-type]


def S(examples: int, recompute: bool = False) -> QuantumShape:
    return QuantumShape(examples, recompute)


def test_shapes_in_the_choice_order_and_their_estimates() -> None:
    fit = _fit()
    assert fit.shapes() == [S(4), S(2), S(1), S(4, True), S(2, True), S(1, True)]
    assert _fit(recompute_bytes_per_token=None).shapes() == [S(4), S(2), S(1)]
    assert _fit(only_recompute=True, max_examples=2).shapes() == [S(2, True), S(1, True)]
    assert fit.estimate_bytes(S(1), SEQ) == 100 * MIB + int(100 * MIB / 0.9)
    assert fit.estimate_bytes(S(4, True), SEQ) == 100 * MIB + int(100 * MIB / 0.9)
    assert S(2, True).label == "2r" and S(4).label == "4"
    assert best([S(1, True), None, S(1), S(2, True)]) == S(1)
    assert best([None]) is None
    with pytest.raises(ValueError, match="only_recompute"):
        _fit(recompute_bytes_per_token=None, only_recompute=True)
    with pytest.raises(ValueError, match=">= 1 example"):
        S(0)
    with pytest.raises(ValueError, match="no bytes per token"):
        _fit(recompute_bytes_per_token=None).estimate_bytes(S(1, True), SEQ)


def test_the_largest_shape_without_recomputation_else_with_it_else_none() -> None:
    fit = _fit()
    one_plain = fit.estimate_bytes(S(1), SEQ)  # 211 MiB
    assert fit.choose(10_000 * MIB, SEQ) == S(4)
    assert fit.choose(one_plain, SEQ) == S(1)
    # just short of one example without: the largest with recomputation (4 at 211 MiB)
    assert fit.choose(one_plain - 1, SEQ) == S(2, True)
    assert fit.choose(fit.estimate_bytes(S(4, True), SEQ), SEQ) == S(1)  # the same 211 MiB
    assert fit.choose(fit.estimate_bytes(S(1, True), SEQ), SEQ) == S(1, True)
    assert fit.choose(fit.estimate_bytes(S(1, True), SEQ) - 1, SEQ) is None
    assert _fit(recompute_bytes_per_token=None).choose(one_plain - 1, SEQ) is None
    assert fit.choose(10_000 * MIB, SEQ, among={S(1, True), S(2)}) == S(2)


def test_a_captured_shape_fits_by_what_its_capture_left_held() -> None:
    fit = _fit()
    fit.record_capture(S(1), 180 * MIB)
    fit.record_capture(S(1), 170 * MIB)  # the larger of two records stays
    assert fit.footprints[S(1)] == 180 * MIB
    assert fit.choose(180 * MIB, SEQ) == S(2, True)  # not held: by the estimate
    assert fit.choose(180 * MIB, SEQ, captured={S(1)}) == S(1)
    assert fit.choose(179 * MIB, SEQ, captured={S(1)}) == S(2, True)


def test_measured_choice_with_a_margin_to_capture_again_and_refused_shapes() -> None:
    fit = _fit()
    for shape, held in ((S(1, True), 120 * MIB), (S(4, True), 150 * MIB), (S(1), 300 * MIB)):
        fit.record_capture(shape, held)
    shared = {S(1, True), S(2, True), S(4, True)}
    assert fit.choose_measured(149 * MIB, shared) == S(1, True)  # 2r was never measured
    assert fit.choose_measured(150 * MIB, shared) == S(4, True)
    assert fit.choose_measured(300 * MIB, {S(1)}, margin=1.1) is None
    assert fit.choose_measured(330 * MIB, {S(1)}, margin=1.1) == S(1)
    assert fit.choose_measured(300 * MIB, {S(1)}, captured={S(1)}, margin=1.1) == S(1)
    assert fit.choose_measured(10**12, {S(1)}, refused={S(1)}) is None


def test_the_warm_up_plan_shares_the_plans_shapes_and_separates_the_better_ones() -> None:
    fit = _fit()
    # room for 2 examples without recomputation: 1 and 2 share a pool, nothing else
    two = fit.estimate_bytes(S(2), SEQ)
    shared, order = fit.warm_plan(two, SEQ)
    assert shared == {S(1), S(2)} and order == [S(1), S(2)]
    # with the release plan: 4 (better in the order, fits it) in a pool of its own
    shared, order = fit.warm_plan(two, SEQ, release_bytes=10_000 * MIB)
    assert shared == {S(1), S(2)} and order == [S(1), S(2), S(4)]
    # not one example without recomputation: the recomputing shapes share the pool, and the
    # release plan adds the plain shapes it fits, smallest estimate first
    fit = _fit(max_examples=2)
    one_plain = fit.estimate_bytes(S(1), SEQ)
    shared, order = fit.warm_plan(one_plain - 1, SEQ, release_bytes=fit.estimate_bytes(S(2), SEQ))
    assert shared == {S(1, True), S(2, True)}
    assert order == [S(1, True), S(2, True), S(1), S(2)]
    # a larger recomputing shape that does not fit the plan is pooled on its own too
    fit = _fit()
    shared, order = fit.warm_plan(one_plain - 1, SEQ, release_bytes=one_plain)
    assert shared == {S(1, True), S(2, True)}
    assert set(order[2:]) == {S(1), S(4, True)}
    # nothing fits: the smallest shape offered is shared, nothing is captured
    shared, order = fit.warm_plan(10 * MIB, SEQ)
    assert shared == {S(1, True)} and order == []
    shared, order = _fit(recompute_bytes_per_token=None).warm_plan(10 * MIB, SEQ)
    assert shared == {S(1)} and order == []
