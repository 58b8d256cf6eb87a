"""`python -m bench.prefix_cache --tiny` end to end on CPU, run as a user would: the result file
(rows per trace and setting, ratios, the check) and the table printed last."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from bench.prefix_cache.args import TINY, parse_args
from bench.prefix_cache.trace import build_trace
from tests.bench.script_runs import RESULT_HEAD, run_script

TOP_KEYS = [*RESULT_HEAD, "rows", "ratios", "check", "targets", "wall_s"]
ROW_KEYS = [
    "model",
    "trace",
    "system",
    "prefix_caching",
    "requests",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "e2e_ms_p50",
    "requests_per_s",
    "prompt_tokens",
    "cached_tokens",
    "cached_frac",
]


def test_trace_is_seeded_and_shares_the_system_prompt() -> None:
    shape = dict(vocab_size=100, system_prompt=20, user_min=2, user_max=5, requests=30)
    trace = build_trace(rate=4.0, seed=3, system_seed=1, **shape)
    assert trace == build_trace(rate=4.0, seed=3, system_seed=1, **shape)
    other = build_trace(rate=4.0, seed=4, system_seed=1, **shape)
    assert other != trace and other[0].prompt[:20] == trace[0].prompt[:20]
    assert len({tuple(r.prompt[:20]) for r in trace}) == 1
    assert all(2 <= r.user_tokens <= 5 and len(r.prompt) == 20 + r.user_tokens for r in trace)
    arrivals = [r.arrival_s for r in trace]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    burst = build_trace(rate=None, seed=3, system_seed=2, **shape)
    assert burst[0].prompt[:20] != trace[0].prompt[:20]
    assert {r.arrival_s for r in burst} == {0.0}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args("x", ["--user-min", "9", "--user-max", "4"])
    assert vars(parse_args("x", ["--tiny"])).items() >= TINY.items()


@pytest.mark.slow
def test_tiny_cpu_run_writes_both_settings_and_prints_the_table_last(tmp_path: Path) -> None:
    stdout, path = run_script(
        "prefix_cache",
        ["--tiny", "--commit", "test"],
        tmp_path,
        "prefix_cache",
        env={"OMP_NUM_THREADS": "1"},
    )
    out = json.loads(path.read_text())
    assert list(out) == TOP_KEYS
    assert (out["name"], out["commit"], out["gpu"]) == ("prefix_cache", "test", "cpu")
    assert datetime.datetime.fromisoformat(out["created"])
    assert out["config"]["system_prompt"] == TINY["system_prompt"]
    rows = out["rows"]
    assert [(r["trace"], r["prefix_caching"]) for r in rows] == [
        ("poisson", False),
        ("poisson", True),
        ("burst", False),
        ("burst", True),
    ]
    assert all(list(r) == ROW_KEYS for r in rows)
    assert [r["requests"] for r in rows] == [TINY["requests"]] * 2 + [TINY["burst_requests"]] * 2
    for r in rows:
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["requests_per_s"] > 0
        if r["prefix_caching"] and r["trace"] == "poisson":
            # every request but the trace's first finds the system prompt's 6 full blocks
            assert r["cached_tokens"] >= (r["requests"] - 1) * 48
        elif r["prefix_caching"]:  # the burst shares the Poisson trace's system prompt
            assert r["cached_tokens"] >= r["requests"] * 48
        else:
            assert r["cached_tokens"] == 0
    poisson = out["ratios"]["poisson"]
    assert poisson["ttft_p50_off_over_on"] == pytest.approx(
        rows[0]["ttft_ms_p50"] / rows[1]["ttft_ms_p50"]
    )
    assert out["check"]["tokens_equal_frac"] == 1.0  # fp32 on CPU: identical greedy tokens
    assert out["targets"]["ttft_p50_ratio_min"] == 5.0
    lines = stdout.strip().splitlines()
    assert lines[-2].startswith("poisson: TTFT p50") and lines[-1].startswith("burst: TTFT p50")
