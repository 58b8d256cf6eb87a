"""SimulatedHost follows its latency model and the loop's semantics."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.colocate.simulator import (
    QuantumCostModel,
    SimulatedHost,
    fit_truth_from_profile,
)
from gpu_runtime.colocation import (
    AnalyticLatencyModel,
    DecodeOnlyPolicy,
    LaunchMode,
    NaivePolicy,
    StaticSplitPolicy,
    summarize,
)
from gpu_runtime.colocation.types import JobView

TRACE = [(0.01 * i, 64, 20) for i in range(10)]
JOB = JobView("ft", 256, 256, 16)
PROFILE = Path(__file__).parents[2] / "predictor_models/data/profile-h200-llama3-8b-engine.csv"


def _host(noise: float = 0.0) -> SimulatedHost:
    truth = AnalyticLatencyModel(
        base_ms=5.0,
        per_seq_ms=0.1,
        per_ctx_token_us=0.0,
        per_prefill_token_us=0.0,
        share_exponent=1.0,
    )
    return SimulatedHost(
        truth,
        QuantumCostModel(overhead_ms=10.0, ms_per_token=0.01),
        decode_sms_options=(66, 132),
        noise_sigma=noise,
        host_overhead_ms=0.0,
    )


def test_decode_only_finishes_every_request_at_the_modelled_tpot() -> None:
    host = _host()
    records = host.run(DecodeOnlyPolicy(), TRACE, duration_s=2.0, tpot_slo_ms=100.0, job=None)
    m = summarize(records, 100.0, start=0.0, end=2.0)
    assert m.finished_requests == len(TRACE) and m.finetune_tokens == 0
    finished = [f for r in records for f in r.finished]
    assert all(f.output_tokens == 20 for f in finished)
    # Pure decode iterations take base + 0.1 per sequence (+ prefill cost when prompts run).
    pure = [r for r in records if r.decode_batch and not r.prefill_tokens]
    assert pure and all(r.observed_ms == pytest.approx(5.0 + 0.1 * r.decode_batch) for r in pure)


def test_quanta_take_their_modelled_time_and_slow_decode_beside_them() -> None:
    host = _host()
    records = host.run(StaticSplitPolicy(66, quantum_examples=2), TRACE, 2.0, 100.0, JOB)
    quanta = [q for r in records for q in r.quanta]
    assert quanta and all(q.mode is LaunchMode.CONCURRENT for q in quanta)
    expected = 10.0 + 512 * 0.01 / 0.5
    assert all(q.duration_ms >= expected - 1e-6 for q in quanta)
    beside = [r for r in records if r.in_flight and r.decode_batch and not r.prefill_tokens]
    assert beside
    for r in beside:  # half the SMs (share exponent 1), plus 8% spatial interference
        assert r.observed_ms == pytest.approx((5.0 + 0.1 * r.decode_batch) * 2 * 1.08)
    naive = host.run(NaivePolicy(1), TRACE, 2.0, 100.0, JOB)
    assert sum(r.finetune_tokens for r in naive) > 0


@pytest.mark.parametrize("during", [False, True])
def test_a_launch_holds_the_host_before_the_step_or_beside_it(during: bool) -> None:
    """``launch_host_ms``: an iteration that launches a concurrent quantum takes launch + step,
    or max(launch, step) when the launch overlaps the step; the others are unchanged."""
    host = _host()
    host.launch_host_ms, host.launch_during_decode = 3.0, during
    records = host.run(StaticSplitPolicy(66, quantum_examples=2), TRACE, 2.0, 100.0, JOB)
    launched = [
        r for r in records if r.finetune_launched and r.decode_batch and not r.prefill_tokens
    ]
    assert launched
    for r in launched:
        step = (5.0 + 0.1 * r.decode_batch) * 2 * (1.08 if r.in_flight else 1.0)
        assert r.observed_ms == pytest.approx(max(step, 3.0) if during else step + 3.0)
    beside = [r for r in records if r.in_flight and not r.finetune_launched and r.decode_batch]
    assert all(
        r.observed_ms == pytest.approx((5.0 + 0.1 * r.decode_batch) * 2 * 1.08)
        for r in beside
        if not r.prefill_tokens
    )
    with pytest.raises(ValueError, match="launch_host_ms must be >= 0"):
        SimulatedHost(host.truth, host.quanta, launch_host_ms=-1.0)


def test_truth_fitted_from_the_committed_h200_profile() -> None:
    truth, costs = fit_truth_from_profile(PROFILE)
    assert truth.fitted_shares[-1] == 1.0 and len(truth.fitted_shares) >= 5
    assert 0 < costs.ms_per_token < 1 and costs.overhead_ms >= 0
    ratio = truth.interference_ratio(1.0, disjoint=False)
    assert ratio is not None and ratio > 1.0


def test_prefill_cost_has_a_fixed_part_per_chunk_step() -> None:
    from bench.colocate.simulator import PrefillCost

    cost = PrefillCost(ms_per_token_full=0.025, fixed_ms=23.0)
    assert cost.ms(0, 0.5) == 0.0  # a pure decode step pays nothing
    assert cost.ms(64, 0.5) == pytest.approx(23.0 + 64 * 0.025 / 0.5)
    assert PrefillCost().ms(64, 1.0) == pytest.approx(64 * 0.025)


def test_drain_runs_until_every_request_has_finished_and_admits_nothing_after_the_window() -> None:
    host = _host()
    trace = [(0.0, 64, 200), (0.01, 64, 200), (0.5, 64, 20)]  # the last arrives after the window
    cut = host.run(DecodeOnlyPolicy(), trace, duration_s=0.2, tpot_slo_ms=100.0, job=None)
    assert not [f for r in cut for f in r.finished]  # 200 tokens at >= 5 ms: none in 0.2 s
    drained = host.run(DecodeOnlyPolicy(), trace, 0.2, 100.0, None, drain_s=30.0)
    finished = sorted(f.request_id for r in drained for f in r.finished)
    assert finished == ["r0", "r1"]  # r2 arrives at 0.5 s, after the arrivals' window
    end = drained[-1].timestamp + drained[-1].iteration_ms / 1e3
    assert 0.2 < end < 0.2 + 30.0  # it stopped once both had finished, not at the drain's end
    with pytest.raises(ValueError, match="drain_s"):
        host.run(DecodeOnlyPolicy(), trace, 0.2, 100.0, None, drain_s=-1.0)


def test_harli_harvests_idle_gaps_alone_and_keeps_every_request_within_the_slo() -> None:
    """Bursts of requests with idle gaps between them: with idle time slices harli runs quanta
    alone on the whole device in the gaps (a request arriving then waits for its first token
    at most one quantum), harvesting more than with quanta only beside decode, and every
    request still meets the SLO; the slower first tokens are bounded by the quantum cap."""
    from gpu_runtime.colocation import HarliConfig, HarliPolicy

    host = _host()
    bursts = [(0.5 * b + 0.004 * i, 64, 30) for b in range(4) for i in range(4)]
    slo = 12.0
    runs = {}
    for cap in (0.0, None):
        config = HarliConfig(idle_slice_ms=cap, max_quantum_ms=60.0, allow_slice=False)
        records = host.run(HarliPolicy(AnalyticLatencyModel(), config), bursts, 2.0, slo, JOB, 1)
        runs[cap] = (records, summarize(records, slo, start=0.0, end=2.0))
    alone_records, alone = runs[None]
    beside_records, beside = runs[0.0]
    idle_alone = [
        q
        for r in alone_records
        if not (r.decode_batch or r.prefill_tokens)
        for q in r.finetune_launched
        if q.mode is LaunchMode.AFTER_DECODE
    ]
    assert idle_alone and not any(
        q.mode is LaunchMode.AFTER_DECODE for r in beside_records for q in r.finetune_launched
    )
    assert alone.finetune_tokens > beside.finetune_tokens
    assert alone.slo_attainment == beside.slo_attainment == 1.0
    assert alone.finished_requests == beside.finished_requests == len(bursts)
    ttfts = [f.ttft_ms for r in alone_records for f in r.finished if f.ttft_ms is not None]
    longest = max(q.duration_ms for r in alone_records for q in r.quanta)
    assert max(ttfts) <= longest + 4 * (5.0 + 0.1 * 4) + 1.0  # a quantum, then the prompts
