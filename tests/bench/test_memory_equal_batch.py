"""Decode iteration time compared at equal batch (`bench/memory_equal_batch.py`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.memory_equal_batch import (
    bins_of,
    bootstrap_interval,
    compare_phases,
    equal_batch_ratio,
    main,
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
    columns = ["decode_batch", "prefill_tokens", "iteration_ms", "step_ms", "wait_ms"]
    table = {
        "columns": columns,
        "phases": {n: [[r[c] for c in columns] for r in rows] for n, rows in phases.items()},
    }
    source = tmp_path / "run.iterations.json"
    source.write_text(json.dumps(table))
    assert main([str(source), "--reps", "20", "--out", str(tmp_path / "eq.json")]) == 0
    written = json.loads((tmp_path / "eq.json").read_text())
    assert set(written["files"]["run.iterations.json"]) == {"unified_over_static_split"}
