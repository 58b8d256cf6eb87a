"""`python -m bench.api_load` at a tiny scale, as a user runs it: the embedded default (the run
command's processes on SQLite), 4 clients for 3 s. The result file has the shape the results
index reads, every request of the mix was sent and answered 200, and every acknowledged create
is in the database exactly once."""

from __future__ import annotations

import json
from pathlib import Path

from bench.api_load.load import OPS
from tests.bench.script_runs import RESULT_HEAD, run_script

ROW_KEYS = {
    "platform", "phase", "clients", "requests", "rps", "latency_ms_p50", "latency_ms_p99",
    "errors", "errors_by_status", "transport_errors", "server_errors_5xx", "ops",
    "db_connections_peak", "acknowledged_creates", "rows_lost", "rows_duplicated",
    "rows_mismatched", "rows_committed_behind_error", "transport_errors_committed",
    "transport_errors_not_committed",
}  # fmt: skip


def test_api_load_on_the_embedded_default_at_a_tiny_scale(tmp_path: Path) -> None:
    args = ["--postgres-clients", "", "--sqlite-clients", "4", "--duration-s", "3",
            "--warmup-s", "1", "--tenants", "1"]  # fmt: skip
    stdout, path = run_script("api_load", args, tmp_path, "api-load")
    result = json.loads(path.read_text())
    assert list(result)[: len(RESULT_HEAD)] == RESULT_HEAD
    assert result["name"] == "api-load" and result["gpu"] == "cpu"
    assert [(r["platform"], r["phase"], r["clients"]) for r in result["rows"]] == [
        ("sqlite", "warmup", 16),
        ("sqlite", "measure", 4),
    ]
    for row in result["rows"]:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["requests"] > 0 and row["rps"] > 0
        assert 0 < row["latency_ms_p50"] <= row["latency_ms_p99"]
        assert row["errors"] == 0, (row["errors_by_status"], row["transport_errors"])
        assert row["acknowledged_creates"] > 0
        assert row["rows_lost"] == row["rows_duplicated"] == row["rows_mismatched"] == 0
        assert row["rows_committed_behind_error"] == 0
        assert row["db_connections_peak"] is None  # SQLite: no server to count connections on
    assert set(result["rows"][0]["ops"]) == set(OPS)  # the warm-up sent every op of the mix
    sqlite = result["platforms"]["sqlite"]
    assert sqlite["rows_without_request"] == 0
    assert sqlite["processes_exited_during_run"] == {}
    assert "sqlite   measure        4" in stdout
