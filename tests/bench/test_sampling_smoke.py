"""`python -m bench.sampling --tiny` on CPU, run as a user would: the result file's keys, its
checks passed before timing, one row per (scheduling, batch, mix) plus a ratio row, the table
printed last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.script_runs import RESULT_HEAD, run_script


@pytest.mark.slow
def test_tiny_cpu_run_writes_rows_ratios_and_the_table(tmp_path: Path) -> None:
    stdout, path = run_script("sampling", ["--tiny"], tmp_path, "sampling")
    result = json.loads(path.read_text())
    assert list(result)[: len(RESULT_HEAD)] == RESULT_HEAD
    assert result["checks"]["forced_token_ok"] and result["checks"]["processed_logits_ok"]
    assert result["checks"]["processed_samples"] > 0
    rows = result["rows"]
    keys = [(r["scheduling"], r["batch"], r["sampling"]) for r in rows]
    mixes = ["plain", "penalties", "penalties/plain"]
    assert keys == [(mode, 2, m) for mode in ("sync", "async") for m in mixes]
    for plain, penalised, ratio in zip(rows[::3], rows[1::3], rows[2::3], strict=True):
        assert plain["steps"] == penalised["steps"] == 8
        assert 0 < plain["tpot_ms_p50"] <= plain["tpot_ms_p99"]
        assert ratio["tpot_ratio_p50"] == pytest.approx(
            penalised["tpot_ms_p50"] / plain["tpot_ms_p50"]
        )
        assert ratio["meets_target"] == (ratio["tpot_ratio_p50"] <= 1.05)
    assert stdout.strip().splitlines()[-1].startswith("async     2    16 penalties/plain")
