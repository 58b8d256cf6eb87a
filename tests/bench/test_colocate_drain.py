"""The co-location bench runs every request to its end: the drive loop's drain on the real
tiny engine, and rows that judge the whole run but rate finetuning over the arrival window."""

from __future__ import annotations

import pytest

from bench.colocate.backends import drive
from bench.colocate.report import row_for
from bench.colocate.simulator import QuantumCostModel, SimulatedHost
from bench.common.traces import TraceRequest
from gpu_runtime.colocation import AnalyticLatencyModel, DecodeOnlyPolicy, HostLoop, NaivePolicy
from gpu_runtime.colocation.types import JobView
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model import build_random_model
from gpu_runtime.model.tiny import tiny_config


def _loop() -> HostLoop:
    model = build_random_model(tiny_config("llama"), seed=3, dtype="float32")
    config = EngineConfig(
        num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=256,
    )  # fmt: skip
    return HostLoop(Engine(model, config), DecodeOnlyPolicy(), tpot_slo_ms=1e6)


TRACE = [
    TraceRequest(0, 0.0, 8, 200, token_seed=1),
    TraceRequest(1, 0.001, 12, 200, token_seed=2),
    TraceRequest(2, 60.0, 8, 20, token_seed=3),  # after the window: never admitted
]
PROMPTS = [r.prompt_ids(256) for r in TRACE]


def test_without_a_drain_the_run_stops_at_the_window_with_requests_still_decoding() -> None:
    running: list = []
    records, start, end = drive(_loop(), TRACE, PROMPTS, 0.01, running=running)
    assert not [f for r in records for f in r.finished]  # 200 tokens do not fit in 10 ms
    assert end - start < 1.0


def test_the_drain_lets_every_admitted_request_finish_then_stops() -> None:
    running: list = []
    records, start, end = drive(_loop(), TRACE, PROMPTS, 0.01, running=running, drain_s=50.0)
    finished = {f.request_id: f for r in records for f in r.finished}
    assert sorted(finished) == ["r0", "r1"] and running == []
    assert all(f.output_tokens == 200 for f in finished.values())
    assert 0.01 < end - start < 50.0  # ended when both were done, long before r2's arrival


def test_a_negative_drain_is_refused() -> None:
    with pytest.raises(ValueError, match="drain_s must be >= 0"):
        drive(_loop(), TRACE, PROMPTS, 0.01, drain_s=-0.5)


def test_rows_rate_finetuning_over_the_arrival_window_and_judge_every_request() -> None:
    truth = AnalyticLatencyModel(
        base_ms=5.0, per_seq_ms=0.1, per_ctx_token_us=0.0, per_prefill_token_us=0.0,
        share_exponent=1.0,
    )  # fmt: skip
    costs = QuantumCostModel(overhead_ms=10.0, ms_per_token=0.01)
    host = SimulatedHost(
        truth, costs, decode_sms_options=(66, 132), noise_sigma=0.0, host_overhead_ms=0.0
    )
    trace = [(0.01 * i, 64, 150) for i in range(6)]
    policy = NaivePolicy(1)
    records = host.run(policy, trace, 0.3, 100.0, JobView("ft", 256, 256, 16), drain_s=10.0)
    end = records[-1].timestamp + records[-1].iteration_ms / 1e3
    assert end > 0.5  # the drain ran: 150 tokens take longer than the window
    row = row_for("tiny", "low", policy, records, 0.0, end, 100.0, 1000.0, [], 0.3)
    in_window = sum(r.finetune_tokens for r in records if r.timestamp < 0.3)
    assert in_window > 0
    assert row["finetune_tokens_per_s"] == pytest.approx(in_window / 0.3, abs=0.1)
    assert row["finetune_tokens_per_s_whole_run"] == pytest.approx(
        sum(r.finetune_tokens for r in records) / end, abs=0.1
    )
    assert row["window_seconds"] == 0.3 and row["seconds"] == round(end, 3)
    assert row["judged_requests"] == 6 and row["unfinished_requests"] == 0
