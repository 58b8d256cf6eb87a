"""`bench/decode/run.py` on CPU. The script is CUDA-only as shipped (its device, the copy bandwidth,
the engine's device and the GPU name), so the end-to-end test runs its `main()` on the tiny
model with exactly those pieces patched: the sweep, the variants, HF eager, the result file and
the table are the script's own. Also the command line, the report's rows, floor and speedups on
given timings, and the names other benches import from it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.decode import engine as decode_engine
from bench.decode import hf as decode_hf
from bench.decode import run as decode
from bench.decode.args import Sweep, apply_quick, parse_args
from bench.decode.bounds import step_bounds, step_kernels
from bench.decode.report import (
    BOUND_KEYS,
    DecodeReport,
    floor_ms,
    print_table,
    print_targets,
    run_config,
    targets,
)
from gpu_runtime.engine import EngineConfig
from gpu_runtime.model import ModelConfig
from tests.bench.script_runs import RESULT_HEAD

# bench/README.md: the row keys of a `decode` result
ROW_KEYS = {
    "model",
    "system",
    "batch",
    "context",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "floor_ms",
    "bandwidth_frac",
}
TOP_KEYS = [
    *RESULT_HEAD,
    "copy_bandwidth_tb_s",
    "dense_bf16_tflops",
    "correctness",
    "rows",
    "complete",
    "speedups",
    "targets",
    "studies",
    "notes",
    "wall_s",
]
TABLE_HEADER = "model       system     batch   ctx   p50 ms   p99 ms   floor   frac   graph   roofl"


def test_command_line_defaults_and_quick() -> None:
    args = parse_args([])
    sweep = Sweep.from_args(args)
    assert sweep.models == ["llama3-8b", "qwen2.5-7b"]
    assert sweep.batches == [1, 8, 32, 64, 128, 256]
    assert sweep.contexts == [512, 2048]
    assert (sweep.hf_eager, sweep.hf_compile) == ([1, 8, 32, 64, 128, 256], [1, 64])
    assert args.hf_compile_models == "llama3-8b,qwen2.5-7b"
    assert sweep.chunks == [256, 512, 1024, 2048]
    assert (sweep.extras, sweep.variants) == ([], ["async", "sync"])
    assert (args.steps, args.warmup, args.hf_context, args.hf_steps) == (40, 5, 512, 10)
    assert not (args.profile or args.quick or args.no_fused or args.mixed_graphs)
    apply_quick(args)
    quick = Sweep.from_args(args)
    assert (quick.models, quick.batches, quick.contexts) == (["llama3-8b"], [8, 64], [512])
    assert (quick.hf_eager, quick.hf_compile, args.steps) == ([64], [], 20)


def test_variants_are_checked_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--variants", "async,no-pdl,pdl-all,sync"])
    assert Sweep.from_args(args).variants == ["async", "no-pdl", "pdl-all", "sync"]
    for bad in ("async,pdl", ","):
        with pytest.raises(SystemExit):
            parse_args(["--variants", bad])
        assert "--variants" in capsys.readouterr().err


def test_report_rows_floor_speedups_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = ModelConfig.preset("tiny")
    args = parse_args(["--models", "tiny", "--batches", "2", "--contexts", "16", "--commit", "c"])
    bandwidth = 1e9
    report = DecodeReport(
        out_dir=tmp_path,
        commit="c",
        gpu="test-gpu",
        config=run_config(args, Sweep.from_args(args)),
        bandwidth=bandwidth,
        correctness={},
        started=0.0,
        flops_per_s=1e11,
    )
    ours = {
        "step_ms": [2.0, 1.0, 3.0],
        "graph_ms": [0.5, 0.5, 0.5],
        "mean_context": 17.5,
        "bucket": 2,
        "phases": {"schedule": [0.1] * 3, "wait": [1.5, 0.5, 2.5]},
    }
    report.add_row("tiny", "harli", 2, 16, ours, config)
    report.add_row("tiny", "harli_sync", 2, 16, ours | {"step_ms": [4.0] * 3}, config)
    report.add_row("tiny", "hf_eager", 2, 16, {"step_ms": [8.0] * 3, "mean_context": 20}, config)
    path, rows, ratios = report.write(complete=True)

    assert path.name.startswith("decode-test-gpu-")  # the GPU's slug, as every bench names it
    out = json.loads(path.read_text())
    assert list(out) == TOP_KEYS
    assert (out["name"], out["commit"], out["gpu"], out["complete"]) == (
        "decode",
        "c",
        "test-gpu",
        True,
    )
    assert out["rows"] == rows and out["speedups"] == ratios
    assert [r["system"] for r in rows] == ["harli", "harli_sync", "hf_eager", "floor"]
    assert all(ROW_KEYS <= set(r) for r in rows)
    harli = rows[0]
    floor = floor_ms(config, 2, 17.5, bandwidth)
    assert harli["floor_ms"] == round(floor, 4) > 0
    assert harli["tpot_ms_p50"] == 2.0 and harli["tpot_ms_p99"] == 2.98  # interpolated
    assert harli["bandwidth_frac"] == round(floor / 2.0, 4)
    assert harli["host_ms_p50"] == 0.5 and harli["schedule_ms_p50"] == 0.1
    assert harli["graph_replay_ms_p50"] == 0.5
    bounds = step_bounds(config, 2, 17.5, floor, bandwidth, 1e11)
    assert {k: harli[k] for k in bounds} == bounds and harli["floor_bw_ms"] == harli["floor_ms"]
    assert harli["roofline_frac"] == round(bounds["floor_roofline_ms"] / 2.0, 4)
    assert rows[3] == {
        "model": "tiny",
        "batch": 2,
        "context": 16,
        "floor_ms": harli["floor_ms"],
        "system": "floor",
        "tpot_ms_p50": harli["floor_ms"],
        "tpot_ms_p99": harli["floor_ms"],
        "bandwidth_frac": 1.0,
    } | {k: harli[k] for k in BOUND_KEYS}
    assert ratios == [
        {"model": "tiny", "batch": 2, "context": 16, "vs": "hf_eager", "ours": o, "speedup": x}
        for o, x in (("harli", 4.0), ("harli_sync", 2.0))
    ]
    assert out["targets"] == targets(rows, ratios)
    assert out["dense_bf16_tflops"] == 0.1

    capsys.readouterr()
    print_table(rows, ratios)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == TABLE_HEADER
    assert lines[1].split()[:4] == ["tiny", "harli", "2", "16"]
    assert lines[3].split()[:4] == ["tiny", "hf_eager", "2", "16"]
    assert lines[1].split()[-1] == f"{bounds['floor_roofline_ms']:.3f}"
    assert lines[4] == "speedup tiny harli b=2 vs hf_eager: 4.0x"
    assert lines[5] == "speedup tiny harli_sync b=2 vs hf_eager: 2.0x"
    assert len(lines) == 6  # no floor row in the table


@pytest.fixture
def cpu_bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CUDA-only pieces of `bench/decode/run.py` pointed at the CPU; nothing else changed."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(decode, "DEVICE", cpu)
    monkeypatch.setattr(decode_hf, "DEVICE", cpu)
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: 1e8)  # tiny floors stay > 0
    monkeypatch.setattr(decode, "dense_throughput", lambda device: 1e10)

    def cpu_engine_config(**kwargs: Any) -> EngineConfig:
        return EngineConfig(**{**kwargs, "device": "cpu"})

    monkeypatch.setattr(decode_engine, "EngineConfig", cpu_engine_config)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: threads only contend
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_bench")
def test_tiny_cpu_run_writes_rows_and_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        *("--models", "tiny", "--batches", "1,2", "--contexts", "16"),
        *("--steps", "3", "--warmup", "1", "--hf-eager", "2", "--hf-compile", ""),
        *("--hf-context", "16", "--hf-steps", "2", "--prefill-chunks", "", "--skip-check"),
        *("--out", str(tmp_path), "--commit", "test"),
    ]
    monkeypatch.setattr(sys, "argv", ["decode.py", *argv])
    decode.main()
    stdout = capsys.readouterr().out

    (path,) = tmp_path.glob("decode-cpu-*.json")
    out = json.loads(path.read_text())
    assert list(out) == TOP_KEYS
    assert (out["commit"], out["gpu"], out["complete"], out["notes"]) == ("test", "cpu", True, [])
    assert out["config"]["models"] == ["tiny"] and out["config"]["variants"] == "async,sync"
    rows = out["rows"]
    assert [(r["system"], r["batch"]) for r in rows] == [
        ("harli", 1),
        ("harli", 2),
        ("harli_sync", 1),
        ("harli_sync", 2),
        ("hf_eager", 2),
        ("floor", 1),
        ("floor", 2),
    ]
    for row in rows:
        assert ROW_KEYS <= set(row), row
        assert row["model"] == "tiny" and row["context"] == 16
        assert row["tpot_ms_p50"] > 0 and row["floor_ms"] > 0 and row["bandwidth_frac"] > 0
    assert all(r["n_steps"] == 3 and "host_ms_p50" in r for r in rows[:4])
    assert [(s["batch"], s["vs"], s["ours"]) for s in out["speedups"]] == [
        (2, "hf_eager", "harli"),
        (2, "hf_eager", "harli_sync"),
    ]
    assert all(row["floor_compute_ms"] > 0 and "floor_roofline_ms" in row for row in rows)
    assert [t["ours"] for t in out["targets"]["bandwidth_frac_b_ge_8"]] == []  # batches < 8

    table = stdout[stdout.index(TABLE_HEADER) :].splitlines()
    assert [line.split()[1] for line in table[1:6]] == ["harli"] * 2 + ["harli_sync"] * 2 + [
        "hf_eager"
    ]
    assert table[6].startswith("speedup tiny harli b=2 vs hf_eager: ")
    assert table[7].startswith("speedup tiny harli_sync b=2 vs hf_eager: ")
    assert len(table) == 8  # no batch 64 or >= 8 rows: no target lines


def test_bounds_of_llama_decode_steps() -> None:
    """Llama-3-8B shape: at batch 8 every kernel is bandwidth-bound (roofline = HBM floor);
    at batch 256 ctx 512 the step is ~3.9 TFLOP and every GEMM compute-bound at 750 TFLOP/s
    and 4.27 TB/s, so the roofline is well above the HBM floor (the issue's b256 miss)."""
    config = ModelConfig.preset("llama3-8b")
    bandwidth, flops = 4.27e12, 750e12
    small = step_bounds(config, 8, 512, floor_ms(config, 8, 512, bandwidth), bandwidth, flops)
    assert small["compute_bound_kernels"] == []
    assert small["floor_roofline_ms"] == pytest.approx(floor_ms(config, 8, 512, bandwidth), 1e-3)
    floor = floor_ms(config, 256, 512, bandwidth)
    big = step_bounds(config, 256, 512, floor, bandwidth, flops)
    assert big["step_tflop"] == pytest.approx(3.9, abs=0.1)
    assert big["compute_bound_kernels"] == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert max(floor, big["floor_compute_ms"]) < big["floor_roofline_ms"] < big["floor_serial_ms"]
    assert big["floor_roofline_ms"] / floor > 1.15
    # the kernels' bytes are the HBM floor's bytes up to the norms (not counted)
    kernel_bytes = sum(b for _, b, _ in step_kernels(config, 256, 512))
    assert kernel_bytes / bandwidth * 1e3 == pytest.approx(floor, rel=1e-3)


def test_targets_name_the_misses(capsys: pytest.CaptureFixture[str]) -> None:
    config = ModelConfig.preset("llama3-8b")
    rows: list[dict[str, Any]] = []
    for system, frac in (("harli", 0.85), ("harli_sync", 0.7)):
        for batch in (1, 8, 64):
            floor = floor_ms(config, batch, 512, 4.27e12)
            rows.append(
                {
                    "model": "llama3-8b",
                    "system": system,
                    "batch": batch,
                    "context": 512,
                    "tpot_ms_p50": floor / frac,
                    "floor_ms": floor,
                    "bandwidth_frac": frac if batch > 1 else 0.5,
                    "floor_roofline_ms": floor,
                }
            )
    rows.append(rows[2] | {"system": "hf_eager", "tpot_ms_p50": rows[2]["tpot_ms_p50"] * 10.5})
    ratios = [
        {
            "model": "llama3-8b",
            "batch": 64,
            "context": 512,
            "vs": "hf_eager",
            "ours": o,
            "speedup": x,
        }
        for o, x in (("harli", 10.5), ("harli_sync", 8.5))
    ]
    goals = targets(rows, ratios)
    assert [(t["ours"], t["met"]) for t in goals["hf_eager_speedup_b64"]] == [
        ("harli", True),
        ("harli_sync", False),
    ]
    by_system = {t["ours"]: t for t in goals["bandwidth_frac_b_ge_8"]}
    assert by_system["harli"]["met"] and by_system["harli"]["min_frac"] == 0.85  # b=1 ignored
    assert not by_system["harli_sync"]["met"]
    assert [b["batch"] for b in by_system["harli_sync"]["below"]] == [8, 64]
    assert by_system["harli_sync"]["below"][0]["roofline_over_floor"] == 1.0
    print_targets(goals)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("10.5x met") and lines[1].endswith("8.5x MISSED")
    assert "MISSED: b8 0.7" in lines[3]
