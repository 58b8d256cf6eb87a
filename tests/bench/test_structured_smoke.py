"""`python -m bench.structured --tiny` end to end on the CPU, run as a user would: the result
file's shape (every system's row, the comparison, the costs) and the table it prints last."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.bench.script_runs import RESULT_HEAD, run_script

SYSTEMS = [
    ("unconstrained", 0),
    ("structured", 2),
    ("unconstrained_sync", 0),
    ("structured_again", 2),
    ("unconstrained_again", 0),
]


@pytest.mark.slow
def test_tiny_cpu_run_writes_every_row_and_prints_the_table_last(tmp_path: Path) -> None:
    stdout, path = run_script(
        "structured", ["--tiny", "--steps", "6"], tmp_path, "structured", {"OMP_NUM_THREADS": "1"}
    )
    out = json.loads(path.read_text())
    assert list(out)[: len(RESULT_HEAD)] == RESULT_HEAD
    assert (out["name"], out["gpu"], out["config"]["model"]) == ("structured", "cpu", "tiny")
    assert out["config"]["batch"] == 4 and out["config"]["constrained_rows"] == 2
    rows = out["rows"]
    assert [(r["system"], r["constrained_rows"]) for r in rows] == SYSTEMS
    for row in rows:
        assert len(row["raw_step_ms"]) == 6
        assert row["tpot_ms_p50"] == pytest.approx(statistics.median(row["raw_step_ms"]), abs=1e-3)
        assert row["tpot_ms_p99"] >= row["tpot_ms_p50"] > 0
        constrained = row["constrained_rows"] > 0
        # constrained steps are masked every step; launched ahead, their sampling is deferred
        assert row["masked_steps"] == (6 if constrained else 0)
        ahead = 0 if row["system"] == "unconstrained_sync" else 6
        assert row["overlapped_steps"] == ahead
        assert row["deferred_samplings"] == (ahead if constrained else 0)
        assert row["grammar_accepts_every_token"] is True
    by = {r["system"]: r for r in rows}
    base = (by["unconstrained"]["tpot_ms_p50"] + by["unconstrained_again"]["tpot_ms_p50"]) / 2
    bound = (by["structured"]["tpot_ms_p50"] + by["structured_again"]["tpot_ms_p50"]) / 2
    comparison = out["comparison"]
    assert comparison["tpot_ratio_p50"] == pytest.approx(bound / base, abs=1e-4)
    assert comparison["met"] == (bound / base <= comparison["target_ratio"] == 1.10)
    costs = out["costs"]
    assert costs["compile_ms"] > costs["cached_ms"] >= 0
    assert costs["mask"]["rows"] == 2 and costs["mask"]["fill_ms_p50"] > 0
    lines = stdout[stdout.index("\nwrote ") :].splitlines()[1:]
    assert lines[0].startswith(f"wrote {path} in ")
    assert lines[1].split() == ["system", "constrained", "p50", "ms", "p99", "ms", "ahead"]
    assert [line.split()[0] for line in lines[2:7]] == [s for s, _ in SYSTEMS]
    assert lines[7].startswith("ratio p50 ")
