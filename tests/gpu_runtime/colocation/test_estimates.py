"""Harli's estimates on their own: the launch overhead's median and the chunk-step mix (recent,
bias-corrected, and remembered after a burst) that the typical iteration is made of."""

from __future__ import annotations

import pytest

from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.typical import TypicalPredictions

MODEL = AnalyticLatencyModel()


def test_one_stalled_launch_does_not_price_the_next_ones() -> None:
    from gpu_runtime.colocation.estimates import LaunchOverhead

    overhead = LaunchOverhead(window=32)
    for excess in (4.0, 5.0, 332.0, 6.0, 5.0):  # one launch captured a new graph shape
        overhead.observe(10.0, 10.0 + excess)
    assert overhead.ms == pytest.approx(5.0)
    overhead.observe(10.0, 8.0)  # a launch faster than predicted lowers the median
    assert overhead.ms == pytest.approx(5.0)
    cheap = LaunchOverhead(window=4)
    for _ in range(4):
        cheap.observe(10.0, 9.0)
    assert cheap.ms == 0.0  # never negative


def test_the_chunk_share_is_right_from_the_first_iterations() -> None:
    """An EMA started at zero would read a third of the share after 8 iterations: the share is
    the weighted mean over what was seen, so a run's first steps count at their true mix."""
    from gpu_runtime.colocation.estimates import PrefillMix

    mix = PrefillMix(smoothing=0.05)
    for i in range(8):  # every other busy iteration carries a chunk
        mix.observe(256 if i % 2 == 0 else 0)
    assert 0.45 < mix.share < 0.55
    for _ in range(300):  # then pure decode for long: the share decays towards 0
        mix.observe(0)
    assert mix.share < 0.01
    for _ in range(300):  # and all chunk steps: towards 1, never above
        mix.observe(64)
    assert 0.99 < mix.share <= 1.0


def test_a_burst_of_chunk_steps_is_remembered_through_the_lull_after_it() -> None:
    from gpu_runtime.colocation.estimates import PrefillMix

    fast = PrefillMix(smoothing=0.05)
    remembering = PrefillMix(smoothing=0.05, memory_smoothing=0.005)
    for mix in (fast, remembering):
        for _ in range(200):  # a burst: a third of the steps carry a chunk
            mix.observe(0)
            mix.observe(0)
            mix.observe(300)
        for _ in range(100):  # then 100 pure decode steps
            mix.observe(0)
    assert fast.share < 0.01 and remembering.share < 0.01  # the recent share has forgotten it
    assert fast.remembered == fast.share  # no memory: nothing more
    assert 0.15 < remembering.remembered < 0.33  # the slow one still weighs the burst
    steady = DecodeSnapshot.from_contexts([512] * 8)
    kinds = remembering.kinds(steady)  # both kinds, weighted by the recent and the kept share
    assert [s.prefill_tokens for _, _, s in kinds] == [0, 300]
    assert kinds[1][0] == pytest.approx(remembering.share)
    assert kinds[1][1] == pytest.approx(remembering.remembered)
    assert [(w, s.prefill_tokens) for w, s in remembering.mix(steady)] == [
        (pytest.approx(1.0 - remembering.share), 0),
        (pytest.approx(remembering.share), 300),
    ]
    with pytest.raises(ValueError, match="memory_smoothing"):
        PrefillMix(smoothing=0.05, memory_smoothing=0.0)


def test_typical_iteration_mixes_chunk_steps_and_pure_decode_steps() -> None:
    from gpu_runtime.colocation.estimates import PrefillMix

    mix = PrefillMix(smoothing=0.05)
    steady = DecodeSnapshot.from_contexts([512] * 16)
    assert [(w, s.prefill_tokens) for w, s in mix.mix(steady)] == [(1.0, 0)]
    # Prompts already queued take their chunk steps out of the horizon at once.
    queued = DecodeSnapshot.from_contexts([512] * 16, prefill_tokens=300, waiting_requests=3)
    kinds = mix.mix(queued)
    assert [s.prefill_tokens for _, s in kinds] == [0, 300]
    assert kinds[1][0] == pytest.approx(4 / mix.horizon)  # 3 waiting + the one in progress
    decode = DecodeSnapshot.from_contexts([512] * 16, waiting_requests=2)
    for i in range(400):  # one busy iteration in ten carries a 512-token chunk
        mix.observe(512 if i % 10 == 0 else 0)
    kinds = mix.mix(decode)
    assert [s.prefill_tokens for _, s in kinds] == [0, 512]
    assert sum(w for w, _ in kinds) == pytest.approx(1.0)
    assert kinds[1][0] == pytest.approx(0.1, abs=0.05)
    assert all(s.batch_size == 18 for _, s in kinds)  # the waiting requests joined
    # Only prompts in flight (no decode rows yet): every step carries a chunk.
    prompts = DecodeSnapshot.from_contexts([], prefill_tokens=300)
    assert [(w, s.prefill_tokens) for w, s in mix.mix(prompts)] == [(1.0, 512)]
    # The expected iteration is the weighted mean of the two kinds, far below a chunk step.
    predictions = TypicalPredictions(MODEL, mix)
    alone = [MODEL.predict_ms(decode_iteration(s, 1.0), None) for _, s in kinds]
    expected = kinds[0][0] * alone[0] + kinds[1][0] * alone[1]
    assert predictions.typical_ms(decode, 1.0, None) == pytest.approx(expected)
    assert expected < 0.5 * alone[1]
