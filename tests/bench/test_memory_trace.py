"""`bench/memory.py trace`: the statistics and warm-up rules on their own, and the whole
three-phase run on the tiny model on CPU (JSON keys, the comparisons, the table)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.memory_phase_row import median_ci, slowest_iterations
from bench.memory_sizing import QuantumSizing, captured_shapes, warm_sizes
from bench.memory_trace import _peak_prior_blocks, job_pool_gib
from bench.memory_trace_report import trace_comparisons

ROOT = Path(__file__).resolve().parent.parent.parent
MIB = 1 << 20


def test_median_interval_brackets_the_median_by_order_statistics() -> None:
    values = [float(v) for v in range(100)]
    low, high = median_ci(values)
    # n = 100: ranks 50 -/+ 1.96 * 10 / 2 = 9.8 -> 40 and 60
    assert (low, high) == (40.0, 60.0)
    assert all(math.isnan(v) for v in median_ci([1.0, 2.0, 3.0]))
    low, high = median_ci([5.0] * 7)
    assert low == high == 5.0


def test_slowest_iterations_are_the_largest_first() -> None:
    rows = [{"iteration_ms": ms, "i": i} for i, ms in enumerate([3.0, 9.0, 1.0, 7.0])]
    assert [r["i"] for r in slowest_iterations(rows, 2)] == [1, 3]


def test_warm_up_runs_one_example_twice_then_each_power_of_two_that_fits() -> None:
    # 1 MiB per token, 100 tokens per example, nothing resident, safety 0.9.
    sizing = QuantumSizing(0, float(MIB), max_examples=8)
    assert warm_sizes(sizing, 50 * MIB, 100) == []  # 45 MiB of room: not one example
    assert warm_sizes(sizing, 120 * MIB, 100) == [1, 1]
    assert warm_sizes(sizing, 500 * MIB, 100) == [1, 1, 2, 4]  # 4.5 examples fit
    assert warm_sizes(sizing, 10_000 * MIB, 100) == [1, 1, 2, 4, 8]  # capped at 8


def test_a_captured_shape_runs_when_what_its_capture_left_held_fits_the_plan() -> None:
    # 1 MiB per token, 100 tokens per example, nothing resident, safety 0.9: the estimate
    # asks 223 MiB for 2 examples; the capture of 1 and 2 examples left 190 MiB held.
    sizing = QuantumSizing(0, float(MIB), max_examples=4)
    assert sizing.tokens(200 * MIB, 100) == 100  # the estimate alone: 1 example
    sizing.record_capture(2, 190 * MIB)
    sizing.record_capture(1, 190 * MIB)
    assert sizing.tokens(200 * MIB, 100, captured={1, 2}) == 200
    assert sizing.tokens(190 * MIB, 100, captured={1, 2}) == 200
    assert sizing.tokens(180 * MIB, 100, captured={1, 2}) == 100  # not held within it
    assert sizing.tokens(200 * MIB, 100, captured={1}) == 100  # graphs dropped: estimate
    assert sizing.tokens(200 * MIB, 100, captured=set()) == 100
    assert sizing.tokens(500 * MIB, 100, captured={1, 2}) == 400  # the estimate is larger
    sizing.record_capture(4, 10 * MIB)
    assert QuantumSizing(0, float(MIB), max_examples=2).tokens(50 * MIB, 100) == 0
    capped = QuantumSizing(0, float(MIB), max_examples=2)
    capped.footprints[4] = 10 * MIB
    assert capped.tokens(50 * MIB, 100, captured={4}) == 0  # above max_examples


def test_captured_shapes_are_the_rows_of_the_held_graph_keys() -> None:
    keys = [SimpleNamespace(rows=2, seq_len=512), SimpleNamespace(rows=1, seq_len=512)]
    graphs = SimpleNamespace(disabled=None, keys=lambda: keys)
    assert captured_shapes(SimpleNamespace(graphs=graphs)) == {1, 2}
    assert captured_shapes(SimpleNamespace(graphs=None)) == set()
    off = SimpleNamespace(disabled="capture failed", keys=lambda: keys)
    assert captured_shapes(SimpleNamespace(graphs=off)) == set()


def test_comparisons_between_phases() -> None:
    def row(policy: str, p50: float, ci: list[float], borrowed: float, tps: float) -> dict:
        return {
            "policy": policy,
            "decode_iter_ms_p50": p50,
            "decode_iter_ms_p99": 2 * p50,
            "pure_decode_iter_ms_p50": p50 / 2,
            "decode_iter_ms_p50_ci95": ci,
            "mean_borrowed_gb": borrowed,
            "finetune_tokens_per_s": tps,
        }

    rows = [
        row("decode_only", 10.0, [9.0, 11.0], 0.0, 0.0),
        {**row("unified", 12.0, [11.5, 12.5], 30.0, 3000.0), "reclaim_ms_p99": 3.0},
        row("static_split", 12.2, [11.8, 12.6], 20.0, 2000.0),
    ]
    out = trace_comparisons(rows)
    assert out["reclaim_ms_p99_over_decode_iter_ms_p50_unified"] == 0.25
    assert out["mean_borrowed_gb_ratio_unified_over_static_split"] == 1.5
    assert out["finetune_tokens_per_s_ratio_unified_over_static_split"] == 1.5
    assert out["decode_iter_ms_p50_ratio_unified_over_decode_only"] == pytest.approx(1.2)
    assert out["decode_iter_ms_p50_ci95_overlap_unified_static_split"] is True
    assert out["decode_iter_ms_p50_ci95_overlap_unified_decode_only"] is False
    assert "finetune_tokens_per_s_ratio_unified_over_decode_only" not in out
    # A failed phase is left out, not compared.
    failed = [rows[0], {"policy": "unified", "error": "boom"}, rows[2]]
    assert set(trace_comparisons(failed)) == {
        "decode_iter_ms_p50_ratio_static_split_over_decode_only",
        "decode_iter_ms_p99_ratio_static_split_over_decode_only",
        "pure_decode_iter_ms_p50_ratio_static_split_over_decode_only",
        "decode_iter_ms_p50_ci95_overlap_static_split_decode_only",
    }


def test_the_job_phases_pool_is_decode_alones_peak_plus_reserve_plus_extra() -> None:
    args = SimpleNamespace(pool_gib=56.0, reserve_low_pages=768, job_pool_extra_gib=12.0)
    alone = {"policy": "decode_only", "kv_peak_gb": 10 * (1 << 30) / 1e9}
    # 10 GiB of KV + 1.5 GiB of reserve + 12 GiB, rounded up to whole GiB
    assert job_pool_gib(args, [alone]) == 24.0
    assert job_pool_gib(args, [{"policy": "unified", "kv_peak_gb": 1.0}]) == 56.0
    big = {"policy": "decode_only", "kv_peak_gb": 60.0}
    assert job_pool_gib(args, [big]) == 56.0  # never above --pool-gib
    # Without decode_only: its peak from an earlier run (M1: 7638 blocks of 2 MiB -> 29 GiB)
    given = SimpleNamespace(**vars(args), decode_only_kv_peak_blocks=7638)
    assert job_pool_gib(given, []) == 29.0
    assert job_pool_gib(given, [], block_bytes=1 << 20) == 21.0  # 7.46 + 1.5 + 12
    assert job_pool_gib(given, [alone]) == 24.0  # this run's decode_only first


def test_the_unified_peak_prior_is_decode_alones_kv_peak_when_asked() -> None:
    rows = [{"policy": "decode_only", "kv_peak_blocks": 321}]
    on = SimpleNamespace(plan_peak_prior="decode_only", plan_peak_window=256)
    assert _peak_prior_blocks(on, rows) == 321
    assert _peak_prior_blocks(on, []) == 0
    given = SimpleNamespace(**vars(on), decode_only_kv_peak_blocks=7638)
    assert _peak_prior_blocks(given, []) == 7638
    assert _peak_prior_blocks(given, rows) == 321
    assert (
        _peak_prior_blocks(SimpleNamespace(plan_peak_prior="none", plan_peak_window=256), rows) == 0
    )
    assert (
        _peak_prior_blocks(SimpleNamespace(plan_peak_prior="decode_only", plan_peak_window=0), rows)
        == 0
    )


def test_unified_without_the_peak_window_is_compared_with_both() -> None:
    base = {"decode_iter_ms_p50": 10.0, "decode_iter_ms_p50_ci95": [9.0, 11.0]}
    rows = [
        {**base, "policy": "unified", "mean_borrowed_gb": 20.0, "finetune_tokens_per_s": 90.0},
        {**base, "policy": "static_split", "mean_borrowed_gb": 10.0, "finetune_tokens_per_s": 90.0},
        {
            **base,
            "policy": "unified_no_peak",
            "mean_borrowed_gb": 30.0,
            "finetune_tokens_per_s": 100.0,
            "reclaim_ms_p99": 50.0,
        },
    ]
    out = trace_comparisons(rows)
    assert out["reclaim_ms_p99_over_decode_iter_ms_p50_unified_no_peak"] == 5.0
    assert out["mean_borrowed_gb_ratio_unified_no_peak_over_static_split"] == 3.0
    assert out["finetune_tokens_per_s_ratio_unified_over_unified_no_peak"] == 0.9


@pytest.mark.slow
def test_three_phases_run_end_to_end_on_the_tiny_model(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(ROOT / "bench" / "memory.py"),
        "trace",
        "--model=tiny",
        "--device=cpu",
        "--duration=2",
        "--drain=1",
        "--pool-gib=0.05",
        "--reserve-low-pages=16",
        "--reserve-high-pages=48",
        "--step-pages=8",
        "--hysteresis=5",
        "--job-pool-extra-gib=1",
        f"--out={tmp_path}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("memory-cpu-*.json")
    result = json.loads(path.read_text())
    rows = {row["policy"]: row for row in result["rows"]}
    assert list(rows) == ["decode_only", "decode_only_split", "unified", "static_split"]
    for policy, row in rows.items():
        assert "error" not in row, row
        assert row["ooms"] == 0 and row["dropped_requests"] == 0
        assert row["decode_iterations"] > 0 and len(row["decode_iter_ms_p50_ci95"]) == 2
        assert len(row["slowest_iterations"]) <= 8
        if policy.startswith("decode_only"):
            assert row["finetune_quanta"] == 0 and row["mean_borrowed_gb"] == 0.0
        else:
            assert row["finetune_quanta"] > 0 and row["finetune_warmup"]["quanta"]
            quanta = row["finetune_quantum_tokens"]
            assert sum(quanta.values()) == row["finetune_quanta"] - len(row["finetune_errors"])
            assert row["finetune_footprints_gib"] == {}  # no CUDA graphs on CPU
    assert "decode_iter_ms_p50_ratio_unified_over_decode_only" in result["comparisons"]
    assert result["config"]["phases"] == "decode_only,decode_only_split,unified,static_split"
    # the job phases' pool from decode_only's KV peak, capped at --pool-gib
    assert result["config"]["pool_gib_per_phase"] == {"unified": 0.05, "static_split": 0.05}
    last = proc.stdout.strip().splitlines()
    assert last[-1].startswith("wrote ") and last[-2].startswith("static_split")
