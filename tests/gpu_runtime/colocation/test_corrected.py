"""The trained predictor corrected online, and predictions asked in one batched call."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot
from gpu_runtime.colocation.corrected import CorrectedLatencyModel
from gpu_runtime.colocation.harli import HarliConfig, HarliPolicy
from gpu_runtime.colocation.latency_model import Pair, decode_iteration, predict_many
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum

from .sim import context

BASE = AnalyticLatencyModel()
ARTIFACTS = Path(__file__).resolve().parents[3] / "predictor_models" / "artifacts"


def _iteration(share: float, prefill: int = 0, batch: int = 16) -> DecodeIteration:
    return DecodeIteration(batch, batch * 600, 900, prefill, share)


QUANTUM = FinetuneQuantum(tokens=512, seq_len=256, lora_rank=16, backward=True, sm_share=0.5)


def test_ratios_are_learnt_per_kind_of_iteration_and_pooled_across_shares() -> None:
    model = CorrectedLatencyModel(BASE, min_samples=4)
    half, decode_only, mixed = 0.5, _iteration(0.5), _iteration(0.5, prefill=256)
    assert model.predict_ms(decode_only, None) == BASE.predict_ms(decode_only, None)
    for _ in range(3):
        model.observe(decode_only, None, 1.3 * BASE.predict_ms(decode_only, None))
    assert model.ratio(half, (False, 0)) == 1.0  # fewer than min_samples: not used yet
    model.observe(decode_only, None, 1.3 * BASE.predict_ms(decode_only, None))
    assert model.predict_ms(decode_only, None) == pytest.approx(
        1.3 * BASE.predict_ms(decode_only, None)
    )
    for _ in range(4):
        model.observe(mixed, QUANTUM, 2.0 * BASE.predict_ms(mixed, QUANTUM))
    assert model.predict_ms(mixed, QUANTUM) == pytest.approx(2.0 * BASE.predict_ms(mixed, QUANTUM))
    # Kinds never observed stay uncorrected; a share never observed takes the kind's pooled
    # ratio.
    assert model.ratio(half, (True, 0)) == 1.0
    other = _iteration(0.75)
    assert model.predict_ms(other, None) == pytest.approx(1.3 * BASE.predict_ms(other, None))
    assert model.describe()["pooled"] == {
        "alone/decode": 1.3,
        "beside/prefill<=256": 2.0,
        "beside/prefill": 2.0,
    }


def test_chunk_steps_are_corrected_per_chunk_size_class_then_over_any_size() -> None:
    model = CorrectedLatencyModel(BASE, min_samples=4)
    small, big = _iteration(1.0, prefill=48), _iteration(1.0, prefill=512)
    for _ in range(4):  # small chunks over-predicted, big ones under-predicted
        model.observe(small, None, 0.5 * BASE.predict_ms(small, None))
        model.observe(big, None, 2.0 * BASE.predict_ms(big, None))
    assert model.predict_ms(small, None) == pytest.approx(0.5 * BASE.predict_ms(small, None))
    assert model.predict_ms(big, None) == pytest.approx(2.0 * BASE.predict_ms(big, None))
    # A class never seen (129-256 tokens) takes the ratio of sums over every chunk size.
    mid = _iteration(1.0, prefill=200)
    coarse = (4 * 0.5 * BASE.predict_ms(small, None) + 4 * 2.0 * BASE.predict_ms(big, None)) / (
        4 * BASE.predict_ms(small, None) + 4 * BASE.predict_ms(big, None)
    )
    assert model.predict_ms(mid, None) == pytest.approx(coarse * BASE.predict_ms(mid, None))
    assert model.predict_ms(_iteration(1.0), None) == BASE.predict_ms(_iteration(1.0), None)
    names = set(model.describe()["pooled"])
    assert names == {"alone/prefill<=64", "alone/prefill>256", "alone/prefill"}


def test_the_correction_follows_mean_latency_with_each_iteration_clipped() -> None:
    model = CorrectedLatencyModel(BASE, min_samples=4, ratio_bounds=(0.25, 8.0))
    it = _iteration(1.0)
    predicted = BASE.predict_ms(it, None)
    for observed in (1.0, 1.0, 1.0, 5.0):  # one slow iteration in four: the mean is 2x
        model.observe(it, None, observed * predicted)
    assert model.ratio(1.0, (False, 0)) == pytest.approx(2.0)  # (a median would say 1)
    stalled = CorrectedLatencyModel(BASE, window=64, min_samples=4, ratio_bounds=(0.25, 8.0))
    for i in range(64):  # a 1000x stall counts as 8x
        stalled.observe(it, None, (1000.0 if i == 10 else 1.1) * predicted)
    assert stalled.ratio(1.0, (False, 0)) == pytest.approx((63 * 1.1 + 8.0) / 64)
    with pytest.raises(ValueError, match="bracket 1"):
        CorrectedLatencyModel(BASE, ratio_bounds=(1.5, 8.0))


def test_predict_many_on_the_onnx_artifact_equals_one_call_per_pair() -> None:
    from gpu_runtime.predictor.artifact import artifact_dir
    from gpu_runtime.predictor.runtime import LatencyPredictor

    predictor = LatencyPredictor.load(artifact_dir(str(ARTIFACTS), "h200", "llama3-8b"))
    pairs: list[Pair] = [
        (_iteration(share, prefill), quantum)
        for share in (48 / 132, 64 / 132, 1.0)
        for prefill in (0, 256)
        for quantum in (None, QUANTUM)
    ]
    batched = predict_many(predictor, pairs)
    single = [predictor.predict_ms(it, q) for it, q in pairs]
    assert batched == pytest.approx(single, rel=1e-5)
    corrected = CorrectedLatencyModel(predictor)
    assert predict_many(corrected, pairs) == pytest.approx(single, rel=1e-5)


class _CountingModel:
    """The analytic model, counting how it is asked."""

    def __init__(self, batched: bool) -> None:
        self.single_calls = 0
        self.batch_calls = 0
        if batched:
            self.predict_many = self._predict_many

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        self.single_calls += 1
        return BASE.predict_ms(iteration, quantum)

    def _predict_many(self, pairs: list[Pair]) -> list[float]:
        self.batch_calls += 1
        return [BASE.predict_ms(it, q) for it, q in pairs]


def test_harli_asks_its_choices_in_one_batch_and_plans_the_same() -> None:
    decode = DecodeSnapshot.from_contexts([512] * 16, prefill_tokens=64)
    slo = BASE.predict_ms(decode_iteration(decode, 1.0), None) * 2.0
    config = HarliConfig(allow_slice=False)
    plans = []
    counters = []
    for batched in (False, True):
        model = _CountingModel(batched)
        plans.append(HarliPolicy(model, config).plan(context(decode, slo)))
        counters.append((model.single_calls, model.batch_calls))
    assert plans[0] == plans[1] and plans[1].launches
    (one_by_one, _), (single, batches) = counters
    # Three batches: the typical iteration alone first (it may settle the plan), the smallest
    # quantum on every split, then the bigger sizes on the splits where the smallest fits.
    assert batches == 3 and single <= 3 < one_by_one


def test_harli_asks_nothing_more_when_decode_alone_is_already_over_the_bound() -> None:
    """The typical iteration alone on the whole device is the kindest any quantum beside decode
    can leave it: over the bound, harli pauses without asking for any split x size."""
    decode = DecodeSnapshot.from_contexts([512] * 16, prefill_tokens=64)
    alone = BASE.predict_ms(decode_iteration(decode, 1.0), None)
    model = _CountingModel(True)
    policy = HarliPolicy(model, HarliConfig(allow_slice=False))
    plan = policy.plan(context(decode, alone * 1.02))  # bound = SLO x (1 - 0.15) < alone
    assert plan.paused and not plan.launches and plan.note == "no safe choice"
    assert model.batch_calls == 1  # the typical iteration alone, nothing else
    roomy = HarliPolicy(_CountingModel(True), HarliConfig(allow_slice=False))
    assert roomy.plan(context(decode, alone * 3.0)).launches  # with room, it launches


def test_served_iterations_replace_seeds_and_outrank_seeds_of_the_same_split() -> None:
    """Seeds (a calibration phase) count until a key has min_samples served iterations; a
    ratio of served iterations on another split is preferred to a seeded one on this split."""
    model = CorrectedLatencyModel(BASE, min_samples=4)
    split, other = _iteration(0.5), _iteration(0.25)
    quantum_other = FinetuneQuantum(512, 256, 16, True, 0.75)
    for _ in range(8):  # calibration under another load: this split looked 1.5x slow
        model.observe(split, QUANTUM, 1.5 * BASE.predict_ms(split, QUANTUM), seed=True)
    assert model.ratio(0.5, (1, 0)) == pytest.approx(1.5)
    assert model.describe()["seeded"] == ["0.5/beside/decode", "beside/decode"]
    # Serving on another split at 1.1x: the seeded 1.5 on this split gives way to it.
    for _ in range(4):
        model.observe(other, quantum_other, 1.1 * BASE.predict_ms(other, quantum_other))
    assert model.ratio(0.25, (1, 0)) == pytest.approx(1.1)
    assert model.ratio(0.5, (1, 0)) == pytest.approx(1.1)
    # Served iterations on this split: below min_samples the pooled served ratio (every
    # split's served iterations, these three too) still comes first, then these alone.
    for _ in range(3):
        model.observe(split, QUANTUM, 1.2 * BASE.predict_ms(split, QUANTUM))
    a, b = BASE.predict_ms(other, quantum_other), BASE.predict_ms(split, QUANTUM)
    pooled = (4 * 1.1 * a + 3 * 1.2 * b) / (4 * a + 3 * b)
    assert model.ratio(0.5, (1, 0)) == pytest.approx(pooled)
    model.observe(split, QUANTUM, 1.2 * BASE.predict_ms(split, QUANTUM))
    assert model.ratio(0.5, (1, 0)) == pytest.approx(1.2)
    assert model.describe()["seeded"] == []


def test_a_quantum_sharing_the_sms_decode_moved_onto_is_its_own_kind() -> None:
    """Decode on the whole device beside a quantum launched on a split's SMs (a placement the
    predictor's profile does not time) neither teaches nor takes the split-beside ratio."""
    model = CorrectedLatencyModel(BASE, min_samples=4)
    launched_on_split = FinetuneQuantum(512, 256, 16, True, 0.5)
    whole = _iteration(1.0)
    shared = FinetuneQuantum(512, 256, 16, True, 1.0)
    for _ in range(4):
        model.observe(whole, launched_on_split, 3.0 * BASE.predict_ms(whole, launched_on_split))
    assert model.ratio(1.0, (2, 0)) == pytest.approx(3.0)
    assert model.predict_ms(whole, shared) == BASE.predict_ms(whole, shared)  # BESIDE: untaught
    assert model.predict_ms(_iteration(0.5), QUANTUM) == BASE.predict_ms(_iteration(0.5), QUANTUM)
    assert "overlap/decode" in model.describe()["pooled"]


def test_observing_a_planned_iteration_does_not_ask_the_base_model_again() -> None:
    calls: list[int] = []

    class Counting(AnalyticLatencyModel):
        def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
            calls.append(1)
            return super().predict_ms(iteration, quantum)

    model = CorrectedLatencyModel(Counting(), min_samples=1)
    planned, other = _iteration(0.5), _iteration(0.5, batch=8)
    model.predict_many([(planned, QUANTUM), (planned, None)])
    asked = len(calls)
    model.observe(planned, QUANTUM, 2.0 * BASE.predict_ms(planned, QUANTUM))
    assert len(calls) == asked  # its base prediction was kept from the plan
    assert model.ratio(0.5, (1, 0)) == pytest.approx(2.0)
    model.observe(other, None, BASE.predict_ms(other, None))
    assert len(calls) == asked + 1  # never planned: asked once
