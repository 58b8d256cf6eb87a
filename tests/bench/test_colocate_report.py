"""The co-location bench's rows say what launching a quantum adds to a token gap: decode
iterations that launched one against those beside a quantum already in flight."""

from __future__ import annotations

import pytest

from bench.colocate.report import launch_iteration_stats, row_for
from bench.colocate.simulator import QuantumCostModel, SimulatedHost
from gpu_runtime.colocation import AnalyticLatencyModel, StaticSplitPolicy
from gpu_runtime.colocation.types import JobView

JOB = JobView("ft", 256, 256, 16)
TRACE = [(0.01 * i, 64, 40) for i in range(10)]


def _host(launch_ms: float, during: bool) -> SimulatedHost:
    """Every decode step 10 ms on the 66-SM split, 10.8 ms beside a quantum (8% spatial
    interference); no noise, no host overhead."""
    truth = AnalyticLatencyModel(
        base_ms=5.0, per_seq_ms=0.0, per_ctx_token_us=0.0, per_prefill_token_us=0.0,
        share_exponent=1.0,
    )  # fmt: skip
    return SimulatedHost(
        truth,
        QuantumCostModel(overhead_ms=10.0, ms_per_token=0.01),
        decode_sms_options=(66, 132),
        noise_sigma=0.0,
        host_overhead_ms=0.0,
        launch_host_ms=launch_ms,
        launch_during_decode=during,
    )


@pytest.mark.parametrize(("during", "launch_step_ms"), [(False, 13.8), (True, 10.8)])
def test_launch_iterations_against_iterations_beside_a_quantum(
    during: bool, launch_step_ms: float
) -> None:
    """The quantum's device work starts with the iteration that launches it, so every step
    beside a quantum takes 10.8 ms; a 3 ms launch before the step makes that iteration's gap
    13.8 ms, from inside the step it adds nothing."""
    policy = StaticSplitPolicy(66, quantum_examples=2)
    records = _host(3.0, during).run(policy, TRACE, 1.0, 100.0, JOB)
    stats = launch_iteration_stats(records)
    launches = stats["launch_iterations"]
    assert launches is not None and launches >= 3
    assert stats["launch_iteration_ms_p50"] == pytest.approx(launch_step_ms)
    assert stats["launch_iteration_ms_max"] == pytest.approx(launch_step_ms)
    assert stats["in_flight_iteration_ms_p50"] == pytest.approx(10.8)
    assert stats["in_flight_iteration_ms_p90"] == pytest.approx(10.8)
    end = records[-1].timestamp + records[-1].iteration_ms / 1e3
    row = row_for("tiny", "low", policy, records, 0.0, end, 100.0, 1000.0, [])
    assert {k: row[k] for k in stats} == stats


def test_no_launches_no_figures() -> None:
    records = _host(0.0, True).run(StaticSplitPolicy(66, quantum_examples=2), [], 0.05, 100.0, JOB)
    stats = launch_iteration_stats(records)
    assert stats["launch_iterations"] == 0
    assert all(value is None for key, value in stats.items() if key != "launch_iterations")
