"""`python -m bench.colocate` end to end on the tiny model on CPU: every policy on every trace,
the JSON it writes and the table it prints last; and the pieces it is built from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.common.examples import synthetic_examples

ROOT = Path(__file__).resolve().parent.parent.parent
POLICIES = ("decode_only", "naive", "time_slice", "static_split", "harli")
TRACES = ("low", "medium")
ROW_KEYS = {
    "model",
    "trace",
    "policy",
    "tpot_slo_ms",
    "slo_attainment",
    "judged_requests",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "finetune_tokens_per_s",
    "solo_finetune_tokens_per_s",
    "solo_fraction",
    "goodput_tokens_per_s",
    "window_seconds",
    "unfinished_requests",
    "iterations",
    "quanta",
    "quantum_errors",
    "decisions",
    "policy_config",
    "launch_iterations",
    "launch_iteration_ms_p50",
    "in_flight_iteration_ms_p50",
}


def _run_bench(args: list[str], out: Path, gpu: str) -> tuple[str, Path]:
    """Run bench/colocate/run.py with ``args`` writing into ``out``: (its stdout, the result file
    for ``gpu``; the run's iterations are beside it)."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.colocate", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = [p for p in out.glob(f"colocate-{gpu}-*.json") if ".iterations." not in p.name]
    return result.stdout, path


@pytest.mark.slow
def test_tiny_cpu_run_writes_every_policy_on_every_trace(tmp_path: Path) -> None:
    stdout, path = _run_bench(
        [
            *("--model", "tiny", "--device", "cpu", "--traces", ",".join(TRACES)),
            *("--duration", "1", "--drain-s", "1", "--calibrate-s", "1", "--warmup-s", "0.5"),
            *("--engine-warmup-s", "0.5", "--ft-seq-len", "64", "--commit", "test"),
        ],
        tmp_path,
        "cpu",
    )
    out = json.loads(path.read_text())
    iterations = json.loads(path.with_suffix(".iterations.json").read_text())
    assert iterations["columns"][:3] == ["t_ms", "decode_batch", "prefill_tokens"]
    assert set(iterations["runs"]) == {f"{t}/{p}" for t in TRACES for p in POLICIES}
    for table in iterations["runs"].values():
        assert table and all(len(row) == len(iterations["columns"]) for row in table)
    assert iterations["request_columns"][:3] == ["request_id", "output_tokens", "tpot_ms"]
    assert set(iterations["requests"]) == set(iterations["runs"])

    assert out["name"] == "colocate"
    assert out["commit"] == "test"
    assert out["simulated"] is False
    assert {"gpu", "torch", "created", "config", "rows", "comparisons", "wall_s"} <= set(out)
    config = out["config"]
    assert config["failed_runs"] == {}
    assert config["skipped_runs"] == []
    assert set(config["traces"]) == set(TRACES)
    assert config["tpot_slo_ms"] > 0
    assert "factor_x_medium_p50" in config["slo_parts_ms"]
    assert config["solo_finetune"]["tokens_per_s_8_examples"] > 0
    assert config["check"]["greedy_token_agreement"] == 1.0
    assert config["engine"]["partition_gemm_sm_target"] is True  # the engine's default
    assert config["engine"]["decode_programmatic_launch_rows"] == 32
    assert config["launch_during_decode"] is True  # HostLoop's default
    assert config["quantum_examples"] == [1, 2, 4]  # calibration's and harli's sizes

    rows = out["rows"]
    assert [(r["trace"], r["policy"]) for r in rows] == [(t, p) for t in TRACES for p in POLICIES]
    for row in rows:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["quantum_errors"] == 0, row["first_quantum_error"]
        assert row["iterations"] > 0
        assert set(row["gpu_state"]) == {"before", "after"}  # nvidia-smi's reading, None on CPU
        assert row["window_seconds"] <= row["seconds"] <= row["window_seconds"] + 3.0
        judged = [
            r[2] for r in iterations["requests"][f"{row['trace']}/{row['policy']}"] if r[2]
        ]  # the requests attainment was judged on, with their TPOT
        assert len(judged) == row["judged_requests"]
        if judged:  # (rounded to 3 decimals: one request at the SLO's edge may read either way)
            met = sum(1 for tpot in judged if tpot <= row["tpot_slo_ms"])
            assert abs(met / len(judged) - row["slo_attainment"]) <= 1 / len(judged) + 1e-9
    by = {(r["trace"], r["policy"]): r for r in rows}
    for trace in TRACES:
        assert by[trace, "decode_only"]["finetune_tokens_per_s"] == 0
        assert by[trace, "decode_only"]["slo_attainment"] in (None, 1.0)  # attainable SLO
        assert by[trace, "naive"]["finetune_tokens_per_s"] > 0  # a quantum every iteration

    comparisons = out["comparisons"]
    assert set(comparisons["per_trace"]) == set(TRACES)
    assert set(comparisons["targets"]) == {
        "harli_attainment_ge_0.99_every_trace",
        "mean_over_best_baseline_ge_1.46",
        "low_load_solo_fraction_ge_0.6",
    }

    lines = stdout[stdout.index("\nTPOT SLO ") :].splitlines()[1:]
    assert lines[0].startswith("TPOT SLO ")
    header = [
        "trace",
        "policy",
        "attain",
        "p50",
        "p99",
        "ft",
        "tok/s",
        "solo%",
        "goodput",
        "ttft99",
    ]
    assert lines[1].split() == header
    table = [line.split() for line in lines[2 : 2 + len(rows)]]
    assert [cells[:2] for cells in table] == [[r["trace"], r["policy"]] for r in rows]
    assert all(len(cells) == 9 for cells in table)
    ttft_p99 = [r["ttft_ms_p99"] or 0.0 for r in rows]
    assert [float(cells[8]) for cells in table] == [pytest.approx(t, abs=0.051) for t in ttft_p99]
    assert all(r["ttft_ms_p99"] is None or r["ttft_ms_p99"] >= r["ttft_ms_p50"] for r in rows)
    assert [line.split(":")[0] for line in lines[2 + len(rows) :]] == [
        *TRACES,
        "mean harli / best baseline (>=99%)",
        "targets",
    ]


@pytest.mark.slow
def test_simulated_run_sweeps_every_fixed_split_for_the_static_baseline(tmp_path: Path) -> None:
    profile = ROOT / "predictor_models" / "data" / "profile-h200-llama3-8b-engine-3557c1e.csv"
    _, path = _run_bench(
        [
            *("--simulate", str(profile), "--traces", "low,high", "--duration", "2"),
            *("--decode-groups", "6,8,12", "--commit", "test", "--sim-launch-host-ms", "2.5"),
            "--no-launch-during-decode",
        ],
        tmp_path,
        "sim",
    )
    out = json.loads(path.read_text())
    assert out["simulated"] is True
    config = out["config"]
    assert (config["sim_launch_host_ms"], config["launch_during_decode"]) == (2.5, False)
    assert "2.5 ms host time per quantum launch (before the decode step)" in config["backend"]
    sweep, chosen = config["static_split_sweep"], config["static_split_decode_sms"]
    choices = config["sharing"]["choices"]
    for trace in ("low", "high"):
        assert set(sweep[trace]) == {str(d) for d in choices[:-1]}  # every split but the whole
        keeping = {d: r for d, r in sweep[trace].items() if r["slo_attainment"] >= 0.99}
        row = next(r for r in out["rows"] if r["trace"] == trace and r["policy"] == "static_split")
        assert row["policy_config"]["decode_sms"] == chosen[trace]
        if keeping:  # the row is the split harvesting most among those keeping the SLO
            best = max(keeping.values(), key=lambda r: r["finetune_tokens_per_s"])
            assert row["finetune_tokens_per_s"] == best["finetune_tokens_per_s"]
            assert row["slo_attainment"] >= 0.99
    runs = json.loads(path.with_suffix(".iterations.json").read_text())["runs"]
    assert {f"low/static_split@{d}" for d in choices[:-1]} <= set(runs)


def test_synthetic_examples_have_the_asked_count_and_length() -> None:
    """The co-location and memory benches build their LoRA job's data with it."""
    ex = synthetic_examples(2, 5, 11, seed=0)
    assert len(ex) == 2 and all(len(e.input_ids) == 5 for e in ex), ex


@pytest.mark.parametrize("start", range(8))
def test_warm_up_runs_every_row_count_whatever_the_batch_position(start: int) -> None:
    """A quantum stops at its optimizer batch's end: the warm-up fills a batch before a size it
    has no room for, so each of 1..4 rows runs (each is its own CUDA graph per stream)."""
    from types import SimpleNamespace

    from bench.colocate.backends import LoopBackend

    data = SimpleNamespace(batch_size=8, position=SimpleNamespace(index=start))
    backend: Any = SimpleNamespace(trainer=SimpleNamespace(stream=data))
    ran = []
    for k in LoopBackend._aligned(backend, (1, 1, 2, 3, 4)):
        rows = min(k, data.batch_size - data.position.index % data.batch_size)
        ran.append(rows)
        data.position.index += rows
    assert {1, 2, 3, 4} <= set(ran)
    assert ran[:2] == [1, 1]  # the first (eager) run on a stream repeats its size


def test_a_fixed_slo_judges_every_policy_and_keeps_the_rules_parts(tmp_path: Path) -> None:
    """``--tpot-slo-ms``: every row is judged against that SLO, the rule's parts are still
    recorded beside it, and the definition says it was fixed; a non-positive one is refused."""
    profile = ROOT / "predictor_models" / "data" / "profile-h200-llama3-8b-engine-3557c1e.csv"
    _, path = _run_bench(
        [
            *("--simulate", str(profile), "--traces", "low", "--duration", "1"),
            *("--policies", "decode_only,harli", "--tpot-slo-ms", "7.5", "--commit", "test"),
        ],
        tmp_path,
        "sim",
    )
    out = json.loads(path.read_text())
    config = out["config"]
    assert config["tpot_slo_ms"] == 7.5 and config["slo_parts_ms"]["fixed"] == 7.5
    assert "factor_x_medium_p50" in config["slo_parts_ms"]
    assert config["slo_definition"].startswith("fixed at 7.5 ms")
    assert {r["tpot_slo_ms"] for r in out["rows"]} == {7.5}
    refused = subprocess.run(
        [sys.executable, "-m", "bench.colocate", "--tpot-slo-ms", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--tpot-slo-ms must be > 0" in refused.stderr


def test_engine_options_follow_the_engine_defaults_and_can_be_changed() -> None:
    from bench.colocate.args import parse_args
    from gpu_runtime.engine import EngineConfig

    default = EngineConfig(num_kv_blocks=8).partition_gemm_sm_target
    assert default is True and parse_args([]).partition_gemm_sm_target is default
    assert parse_args(["--no-partition-gemm-sm-target"]).partition_gemm_sm_target is False
    rows = EngineConfig(num_kv_blocks=8).decode_programmatic_launch_rows
    assert parse_args([]).decode_programmatic_launch_rows == rows == 32
    assert (
        parse_args(["--decode-programmatic-launch-rows", "0"]).decode_programmatic_launch_rows == 0
    )


def test_quantum_sizes_are_distinct_ascending_positive_integers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench.colocate.args import parse_args

    assert parse_args([]).quantum_examples == (1, 2, 4)
    assert parse_args(["--quantum-examples", "1,2,4,8"]).quantum_examples == (1, 2, 4, 8)
    for bad, says in (("4,2", "distinct and ascending"), ("2,2", "distinct"), ("0,1", "positive")):
        with pytest.raises(SystemExit):
            parse_args(["--quantum-examples", bad])
        assert says in capsys.readouterr().err
