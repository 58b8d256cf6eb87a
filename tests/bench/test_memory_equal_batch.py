"""Decode iteration time compared at equal batch (`bench/memory/equal_batch.py`)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.memory.equal_batch import (
    WITHIN_NOISE_RULE,
    bins_of,
    bootstrap_interval,
    compare_phases,
    equal_batch_ratio,
    has_repeats,
    is_a_a,
    largest_a_a_distance,
    main,
    noise_lines,
)


def _rows(batches: list[int], per_row_ms: float, seed: int) -> list[dict[str, Any]]:
    """Iterations whose time grows with the batch (5 ms + per_row_ms a row, 1% noise); every
    tenth carries a prefill chunk (+8 ms)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i, batch in enumerate(batches):
        chunk = 256 if i % 10 == 0 else 0
        ms = (5.0 + per_row_ms * batch + (8.0 if chunk else 0.0)) * rng.uniform(0.99, 1.01)
        rows.append(
            {
                "decode_batch": batch,
                "prefill_tokens": chunk,
                "iteration_ms": ms,
                "step_ms": ms * 0.95,
                "wait_ms": None if i % 7 == 0 else ms * 0.9,
            }
        )
    return rows


def _iterations_file(path: Path, phases: dict[str, list[dict[str, Any]]]) -> Path:
    """Write `phases` as `python -m bench.memory trace` writes its `.iterations.json`; returns
    `path`."""
    columns = ["decode_batch", "prefill_tokens", "iteration_ms", "step_ms", "wait_ms"]
    table = {
        "columns": columns,
        "phases": {n: [[r[c] for c in columns] for r in rows] for n, rows in phases.items()},
    }
    path.write_text(json.dumps(table))
    return path


def test_a_phase_with_larger_batches_is_judged_at_equal_batch() -> None:
    """The same per-iteration cost, but one phase's batches run larger: its all-iteration
    median is far slower, its equal-batch ratio is 1.0. A phase 2% slower per iteration at the
    same batches reads 1.02."""
    rng = random.Random(1)
    base = _rows([rng.randint(40, 80) for _ in range(3000)], 0.1, seed=2)
    bigger = _rows([rng.randint(50, 90) for _ in range(3000)], 0.1, seed=3)
    slower = [
        {**row, "iteration_ms": row["iteration_ms"] * 1.02}
        for row in _rows([rng.randint(40, 80) for _ in range(3000)], 0.1, seed=4)
    ]
    medians = [sorted(r["iteration_ms"] for r in rows)[1500] for rows in (bigger, base)]
    assert medians[0] / medians[1] > 1.05
    ratio = equal_batch_ratio(bins_of(bigger, "iteration_ms"), bins_of(base, "iteration_ms"))
    assert ratio == pytest.approx(1.0, abs=0.004)
    a, b = bins_of(slower, "iteration_ms"), bins_of(base, "iteration_ms")
    assert equal_batch_ratio(a, b) == pytest.approx(1.02, abs=0.004)
    interval = bootstrap_interval(a, b, reps=100)
    assert interval is not None and interval[0] < 1.02 < interval[1] and interval[0] > 1.0


def test_bins_leave_out_idle_iterations_and_missing_values() -> None:
    rows: list[dict[str, Any]] = [
        {"decode_batch": 0, "prefill_tokens": 0, "wait_ms": 1.0},
        {"decode_batch": 5, "prefill_tokens": 0, "wait_ms": None},
        {"decode_batch": 5, "prefill_tokens": 0, "wait_ms": 2.0},
        {"decode_batch": 6, "prefill_tokens": 64, "wait_ms": 3.0},
    ]
    assert bins_of(rows, "wait_ms") == {(1, False): [2.0], (1, True): [3.0]}
    with pytest.raises(ValueError, match="bin_width"):
        bins_of(rows, "wait_ms", bin_width=0)
    assert equal_batch_ratio(bins_of(rows, "wait_ms"), bins_of(rows, "wait_ms")) is None


def test_every_phase_is_compared_with_the_static_split(tmp_path: Path) -> None:
    rng = random.Random(5)
    phases = {
        name: _rows([rng.randint(8, 40) for _ in range(800)], per_row, seed)
        for seed, (name, per_row) in enumerate([("static_split", 0.1), ("unified", 0.11)])
    }
    out = compare_phases(phases, reps=50)
    assert list(out) == ["unified_over_static_split"]
    for key in ("iteration_ms", "step_ms", "wait_ms"):
        entry = out["unified_over_static_split"][key]
        assert entry["ratio"] > 1.0 and entry["ci95"][0] <= entry["ratio"] <= entry["ci95"][1]
    with pytest.raises(ValueError, match="no 'static_split' phase"):
        compare_phases({"unified": phases["unified"]})
    # The command line reads an iterations file and writes the comparisons.
    source = _iterations_file(tmp_path / "run.iterations.json", phases)
    assert main([str(source), "--reps", "20", "--out", str(tmp_path / "eq.json")]) == 0
    written = json.loads((tmp_path / "eq.json").read_text())
    assert set(written["files"]["run.iterations.json"]) == {"unified_over_static_split"}
    # bench/results/ keeps them gzipped: the same comparisons from the .gz file
    packed = tmp_path / "run.iterations.json.gz"
    packed.write_bytes(gzip.compress(source.read_bytes()))
    assert main([str(packed), "--reps", "20", "--out", str(tmp_path / "gz.json")]) == 0
    from_gz = json.loads((tmp_path / "gz.json").read_text())["files"]["run.iterations.json.gz"]
    assert from_gz == written["files"]["run.iterations.json"]


def _scaled(rows: list[dict[str, Any]], factor: float) -> list[dict[str, Any]]:
    """``rows`` with every time ``factor`` times as long (the same batches and chunks)."""
    keys = ("iteration_ms", "step_ms", "wait_ms")
    return [{**r, **{k: None if r[k] is None else r[k] * factor for k in keys}} for r in rows]


def _repeated_run(unified: float, unified_again: float) -> dict[str, list[dict[str, Any]]]:
    """An interleaved run whose static_split repeat is 1% slower than its first run (the A/A
    spread, 0.01 from 1.0) and whose unified runs are ``unified`` and ``unified_again`` times
    the static split's first run, iteration for iteration."""
    rng = random.Random(7)
    base = _rows([rng.randint(8, 40) for _ in range(800)], 0.1, seed=8)
    return {
        "static_split": base,
        "unified": _scaled(base, unified),
        "static_split#2": _scaled(base, 1.01),
        "unified#2": _scaled(base, unified_again),
    }


def test_repeats_give_the_same_runs_noise_and_a_verdict_against_it(tmp_path: Path) -> None:
    within = compare_phases(_repeated_run(1.005, 1.004), reps=30)
    assert list(within) == [
        "unified_over_static_split",
        "unified#2_over_static_split#2",
        "unified_over_static_split#2",
        "unified#2_over_static_split",
        "static_split#2_over_static_split",
        "unified#2_over_unified",
    ]
    # A/A: the same binning and bootstrap; static_split's 1.01 is the largest distance
    static_a_a = within["static_split#2_over_static_split"]["iteration_ms"]
    assert static_a_a["ratio"] == pytest.approx(1.01, abs=1e-9)
    assert static_a_a["ci95"][0] <= 1.01 <= static_a_a["ci95"][1]
    assert within["unified#2_over_unified"]["step_ms"]["ratio"] == pytest.approx(1.004 / 1.005)
    assert "within_noise" not in within["unified#2_over_unified"]["wait_ms"]
    assert largest_a_a_distance(within)["iteration_ms"] == pytest.approx(0.01)
    expected = {
        "unified_over_static_split": 1.005,
        "unified#2_over_static_split#2": 1.004 / 1.01,
        "unified_over_static_split#2": 1.005 / 1.01,
        "unified#2_over_static_split": 1.004,
    }
    for pair, ratio in expected.items():
        for key in ("iteration_ms", "step_ms", "wait_ms"):
            assert within[pair][key]["ratio"] == pytest.approx(ratio)
            assert within[pair][key]["within_noise"] is True
    # 3% slower per iteration against 1% of A/A spread: outside noise, however paired
    outside = compare_phases(_repeated_run(1.03, 1.03), reps=30)
    for pair in expected:
        assert {outside[pair][key]["within_noise"] for key in ("iteration_ms", "wait_ms")} == {
            False
        }
    # Only the static split repeated: its A/A still sets the noise for the single unified run.
    run = _repeated_run(1.005, 1.0)
    del run["unified#2"]
    single = compare_phases(run, reps=30)
    assert set(single) == {
        "unified_over_static_split",
        "unified_over_static_split#2",
        "static_split#2_over_static_split",
    }
    assert single["unified_over_static_split"]["iteration_ms"]["within_noise"] is True
    # The command line prints the rule, the A/A spread and the verdicts, and writes them.
    source = _iterations_file(tmp_path / "interleaved.iterations.json", _repeated_run(1.03, 1.03))
    assert main([str(source), "--reps", "20", "--out", str(tmp_path / "eq.json")]) == 0
    written = json.loads((tmp_path / "eq.json").read_text())
    assert written["config"]["within_noise"] == WITHIN_NOISE_RULE
    pairs = written["files"]["interleaved.iterations.json"]
    assert pairs["unified#2_over_static_split#2"]["step_ms"]["within_noise"] is False
    lines = noise_lines(pairs)
    assert "largest A/A distance from 1.0: iteration_ms 0.0100" in lines[3]
    verdict = next(line for line in lines if "unified_over_static_split " in line)
    assert "iteration_ms 1.0300 OUTSIDE" in verdict


def test_without_repeats_the_verdict_is_null_and_nothing_else_is_added() -> None:
    rng = random.Random(9)
    base = _rows([rng.randint(8, 40) for _ in range(400)], 0.1, seed=10)
    phases = {"static_split": base, "unified": _scaled(base, 1.02)}
    out = compare_phases(phases, reps=10)
    assert list(out) == ["unified_over_static_split"]
    assert set(out["unified_over_static_split"]) == {"iteration_ms", "step_ms", "wait_ms"}
    for entry in out["unified_over_static_split"].values():
        assert set(entry) == {"ratio", "ci95", "within_noise"} and entry["within_noise"] is None
    assert noise_lines(out) == [] and not has_repeats(phases)
    assert has_repeats([*phases, "unified#2"]) and is_a_a("unified#2_over_unified")
    assert not is_a_a("unified_release_over_unified")
