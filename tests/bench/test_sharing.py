"""bench/sharing/run.py on CPU: its options and their refusals, the rows and figures it derives from
measured times, the result file (bench/README.md's layout and name) and the table it prints, and
its clear refusal without CUDA. The measurements themselves (partitions, timing, graph replay,
torch's GreenContext) need an H200 and are left to the GPU run."""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.sharing import run as sharing
from bench.sharing.args import parse_args
from bench.sharing.measure import _decode_row
from bench.sharing.report import build_result, print_report, result_path
from tests.bench.script_runs import RESULT_HEAD, ROOT

DECODE_BYTES = 16 * 4096 * 14336 * 2 + 16 * 64 * (4096 + 14336) * 2
"""Weights plus activations of the decode pass: 1 916 796 928 bytes."""
COPY_TBS = 4.2713
NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the script would run the benchmark"
)


def _days() -> set[str]:
    """Today in UTC, and the day a minute ago, for a check that may straddle midnight."""
    now = datetime.datetime.now(datetime.UTC)
    return {f"{d:%Y%m%d}" for d in (now, now - datetime.timedelta(minutes=1))}


def _gemm_row(experiment: str, mech: str, dsms: int, fsms: int, ms: float) -> dict[str, Any]:
    """A big-GEMM row as ``solo_rows`` / ``beside_rows`` build it (8192^3 bf16 GEMM)."""
    row: dict[str, Any] = {
        "experiment": experiment,
        "mechanism": mech,
        "decode_sms": dsms,
        "finetune_sms": fsms,
    }
    if experiment == "gemm_beside_decode":
        row["background"] = "decode_pass"
    row["gemm_ms_p50"] = ms
    row["gemm_tflops"] = 2 * 8192**3 / ms / 1e9
    if experiment == "gemm_beside_decode":
        row["gemm_frac_of_full"] = 1.381 / ms
    return row


def _times(warmup: float, p50: float) -> list[float]:
    """Three slow warm-up calls, then 30 timed calls spread +-1.45% around ``p50``."""
    return [warmup] * 3 + [p50 * (1 + (i - 14.5) / 1000) for i in range(30)]


def _rows() -> list[dict[str, Any]]:
    """A run's rows (figures of an H200 result, in the order ``main`` adds them)."""
    return [
        _decode_row(DECODE_BYTES, COPY_TBS, "decode_alone", "green_context", 48, 84, "none",
                    _times(5.0, 0.7156)),
        _gemm_row("gemm_alone", "green_context", 48, 84, 2.0105),
        _decode_row(DECODE_BYTES, COPY_TBS, "decode_alone", "streams", 132, 0, "none",
                    _times(5.0, 0.5233)),
        _gemm_row("gemm_alone", "streams", 0, 132, 1.381),
        _decode_row(DECODE_BYTES, COPY_TBS, "decode_beside_gemm", "green_context", 48, 84,
                    "gemm8192", _times(5.0, 0.8505)),
        _gemm_row("gemm_beside_decode", "green_context", 48, 84, 2.4222),
        _decode_row(DECODE_BYTES, COPY_TBS, "decode_beside_gemm", "naive", 132, 0, "gemm8192",
                    _times(20.0, 9.4416)),
        _gemm_row("gemm_beside_decode", "naive", 132, 0, 1.4215),
    ]  # fmt: skip


def _notes() -> dict[str, Any]:
    """A run's notes as ``prepare_bench``, ``_guard`` and ``main`` leave them."""
    return {
        "partition_creation_s_total": 0.1919,
        "partition_creation_s_contexts": 0.0321,
        "partitions_created": 2,
        "granted_sms": {"48": [48, 84], "56": [56, 76]},
        "copy_bandwidth_tbs": COPY_TBS,
        "partition_output_rel_err": 0.0,
        "solo_status": "ok",
        "beside_status": "ok",
        "switch": {
            "fixed48_ms": 0.7475,
            "fixed56_ms": 0.5856,
            "alternating_ms": 0.6472,
            "switch_overhead_ms": -0.0193,
            "partition_lookup_us": 1.8012,
        },
        "graphs": {"error": "RuntimeError: CUDA error: operation not permitted when capturing"},
    }


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    args = parse_args(sharing.__doc__ or "", [])
    assert vars(args) == {
        "out": "bench/results",
        "commit": None,
        "reps": 30,
        "groups": None,
        "probe": False,
    }
    monkeypatch.setenv("OUT", "/tmp/device-out")
    assert parse_args("", []).out == "/tmp/device-out"


def test_groups_are_a_tuple_of_ints_and_empty_means_every_group() -> None:
    argv = ["--groups", "2,4,6,7,8,9,10,12,14", "--reps", "4", "--probe", "--commit", "46d4fa5"]
    args = parse_args("", argv)
    assert args.groups == (2, 4, 6, 7, 8, 9, 10, 12, 14)
    assert (args.reps, args.probe, args.commit) == (4, True, "46d4fa5")
    assert parse_args("", ["--groups", ""]).groups is None
    # a probe only creates partitions: any groups will do
    assert parse_args("", ["--groups", "2,4", "--probe"]).groups == (2, 4)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--groups", "a"], "--groups"),
        (["--groups", "6,x"], "--groups"),
        (["--groups", "0"], "--groups"),
        (["--groups", "6,-1"], "--groups"),
        (["--groups", "2,4,6"], "missing 7,9"),  # the 56 and 72-SM partitions are measured
        (["--reps", "x"], "--reps"),
        (["--reps", "3"], "--reps"),  # every figure drops 3 warm-up calls: nothing left to time
        (["--reps", "0"], "--reps"),
        (["--green"], "--green"),
    ],
)
def test_bad_options_are_the_parsers_error(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args("", argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and named in err, err


def test_decode_row_drops_warmup_and_derives_bandwidth() -> None:
    timed = [0.700 + 0.001 * i for i in range(30)]
    row = _decode_row(
        DECODE_BYTES, COPY_TBS, "decode_alone", "green_context", 48, 84, "none", [9.0] * 3 + timed
    )
    p50 = statistics.median(timed)  # 0.7145 ms; with the warm-up it would be 0.716
    assert row == {
        "experiment": "decode_alone",
        "mechanism": "green_context",
        "decode_sms": 48,
        "finetune_sms": 84,
        "background": "none",
        "decode_pass_ms_p50": pytest.approx(0.7145),
        # between the two slowest timed calls (linear interpolation), not a 9 ms warm-up
        "decode_pass_ms_p99": pytest.approx(0.72871),
        "bandwidth_tbs": pytest.approx(DECODE_BYTES / p50 / 1e9),
        "bandwidth_frac": pytest.approx(DECODE_BYTES / p50 / 1e9 / COPY_TBS),
    }
    assert row["bandwidth_tbs"] == pytest.approx(2.6827, abs=1e-4)
    assert 0 < row["bandwidth_frac"] < 1


def test_a_section_that_fails_is_recorded_and_the_run_goes_on() -> None:
    notes: dict[str, Any] = {}
    assert sharing._guard(notes, "switch", lambda: {"fixed48_ms": 0.75}) == {"fixed48_ms": 0.75}
    assert sharing._guard(notes, "graphs", lambda: 1 / 0) is None
    assert notes == {
        "switch": {"fixed48_ms": 0.75},
        "graphs": {"error": "ZeroDivisionError: division by zero"},
    }


def test_result_file_has_the_benchmarks_layout(tmp_path: Path) -> None:
    notes, rows = _notes(), _rows()
    result = build_result("46d4fa5", "NVIDIA H200", 132, DECODE_BYTES, 30, notes, rows)
    assert list(result) == [*RESULT_HEAD, "notes", "rows"]
    assert (result["name"], result["commit"], result["gpu"]) == (
        "sharing",
        "46d4fa5",
        "NVIDIA H200",
    )
    assert result["torch"] == torch.__version__
    created = datetime.datetime.fromisoformat(result["created"])
    assert created.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.UTC) - created) < datetime.timedelta(minutes=1)
    assert result["config"] == {
        "decode_pass": "16x [64,4096]@[4096,14336]",
        "decode_bytes": 1_916_796_928,
        "big_gemm": 8192,
        "reps": 30,
        "sms": 132,
    }
    # main writes the file, then adds torch's GreenContext figures to notes and writes it again.
    path = result_path(str(tmp_path / "results" / "new"), "NVIDIA H200")
    notes["torch_green_context"] = {"create_ms": 2.667, "push_pop_us": 11.19}
    path.write_text(json.dumps(result, indent=1))
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    written = json.loads(path.read_text())
    assert written["notes"]["torch_green_context"] == {"create_ms": 2.667, "push_pop_us": 11.19}
    assert written["rows"] == rows and written["notes"]["graphs"]["error"].startswith("Runtime")
    for row in written["rows"]:
        assert 0 < row.get("bandwidth_frac", 0.5) < 1 and 0 < row.get("gemm_frac_of_full", 0.5) <= 1


def test_result_commit_defaults_to_the_runners_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARLI_COMMIT", "e422b92")
    result = build_result(None, "NVIDIA H200", 132, DECODE_BYTES, 30, {}, [])
    assert result["commit"] == "e422b92"


def test_result_path_is_named_by_gpu_and_day(tmp_path: Path) -> None:
    out = tmp_path / "not" / "yet"
    path = result_path(str(out), "NVIDIA H200")
    assert out.is_dir() and path.parent == out
    assert path.name in {f"sharing-h200-{day}.json" for day in _days()}, path.name
    # a variant's last word is not its GPU: named like every bench's file (provenance.gpu_slug)
    nvl = result_path(str(out), "NVIDIA H200 NVL")
    assert nvl.name in {f"sharing-h200-{day}.json" for day in _days()}, nvl.name


def test_report_prints_notes_then_one_table_line_per_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes, rows = _notes(), _rows()
    path = tmp_path / "sharing-h200-20261130.json"
    print_report(notes, rows, path)
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("experiment"))
    assert json.loads("\n".join(lines[:header])) == notes
    assert lines[header].split() == ["experiment", "mech", "dSM", "fSM", "bg", "ms", "TB/s",
                                     "TFLOP/s"]  # fmt: skip
    table = [line.split() for line in lines[header + 1 : -1]]
    assert table == [
        ["decode_alone", "green_context", "48", "84", "none", "0.716", "2.68", "0.0"],
        ["gemm_alone", "green_context", "48", "84", "2.010", "0.00", "546.9"],
        ["decode_alone", "streams", "132", "0", "none", "0.523", "3.66", "0.0"],
        ["gemm_alone", "streams", "0", "132", "1.381", "0.00", "796.2"],
        ["decode_beside_gemm", "green_context", "48", "84", "gemm8192", "0.851", "2.25", "0.0"],
        ["gemm_beside_decode", "green_context", "48", "84", "decode_pass", "2.422", "0.00",
         "453.9"],
        ["decode_beside_gemm", "naive", "132", "0", "gemm8192", "9.442", "0.20", "0.0"],
        ["gemm_beside_decode", "naive", "132", "0", "decode_pass", "1.421", "0.00", "773.5"],
    ]  # fmt: skip
    assert lines[-1] == f"wrote {path}"


def _run(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    """``python -m bench.sharing ARGS --out OUT`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "bench.sharing", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@NO_CUDA
def test_without_cuda_the_script_refuses_in_one_line(tmp_path: Path) -> None:
    done = _run(out=tmp_path / "out")
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "bench.sharing measures SM partitions and streams on a CUDA GPU; "
        f"torch {torch.__version__} sees none"
    )
    assert not (tmp_path / "out").exists()


@NO_CUDA
def test_without_cuda_the_probe_reports_where_it_failed(tmp_path: Path) -> None:
    done = _run("--probe", "--groups", "6,7,9", out=tmp_path / "out")
    assert done.returncode == 1 and done.stderr == ""
    assert done.stdout.strip() == (
        "PROBE groups=(6, 7, 9) FAIL at create: GreenContextError: CUDA is not available"
    )


def test_bad_groups_stop_the_script_before_any_gpu_work(tmp_path: Path) -> None:
    done = _run("--groups", "6,seven", out=tmp_path / "out")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].endswith("--groups: '6,seven' is not a comma list of ints")
