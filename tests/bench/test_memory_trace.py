"""`python -m bench.memory trace`: the statistics and warm-up rules on their own, and the whole
three-phase run on the tiny model on CPU (JSON keys, the comparisons, the table)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.memory.args import parse_phases
from bench.memory.iterations import ITERATION_COLUMNS, IterationLog, _host_allocs_reader
from bench.memory.phase_row import median_ci
from bench.memory.sizing import QuantumSizing
from bench.memory.trace import _peak_prior_blocks, _static_decode_pages, job_pool_gib
from bench.memory.trace_report import trace_comparisons
from gpu_runtime.finetune.quantum_fit import QuantumShape
from gpu_runtime.memory import MemoryWork
from tests.bench.memory_runs import run_tiny_trace

MIB = 1 << 20


def test_median_interval_brackets_the_median_by_order_statistics() -> None:
    values = [float(v) for v in range(100)]
    low, high = median_ci(values)
    # n = 100: ranks 50 -/+ 1.96 * 10 / 2 = 9.8 -> 40 and 60
    assert (low, high) == (40.0, 60.0)
    assert all(math.isnan(v) for v in median_ci([1.0, 2.0, 3.0]))
    low, high = median_ci([5.0] * 7)
    assert low == high == 5.0


def _fake_phase(stats: dict[str, int] | None) -> tuple[SimpleNamespace, SimpleNamespace]:
    backend = SimpleNamespace(allocator_stats=lambda: dict(stats or {}))
    memory = SimpleNamespace(
        manager=SimpleNamespace(pool=SimpleNamespace(backend=backend)),
        last_before=MemoryWork(),
        last_after=MemoryWork(),
    )
    times = SimpleNamespace(launch=0.002, wait=0.2)
    engine = SimpleNamespace(
        last_step_times=times, block_manager=SimpleNamespace(num_used_blocks=7)
    )
    return memory, engine


def _record(t: float, ms: float, batch: int, prefill: int = 0, beside: int = 0) -> SimpleNamespace:
    launch = SimpleNamespace(max_tokens=1024)
    return SimpleNamespace(
        timestamp=t,
        decode_batch=batch,
        prefill_tokens=prefill,
        iteration_ms=ms,
        observed_ms=ms - 1.0,
        in_flight=bool(beside),
        beside_tokens=beside or 2048,
        finetune_launched=(launch,) if not beside else (),
        quanta=(),
    )


def test_iteration_rows_say_what_ran_before_and_after_the_step() -> None:
    stats = {"segments": 3, "reserved_bytes": 1 << 30, "device_allocs": 10, "device_frees": 2}
    stats |= {"alloc_retries": 0, "sync_all_streams": 5}
    memory, engine = _fake_phase(stats)
    log = IterationLog(memory, engine, cuda=True)
    log._host = None  # no pinned-allocator stats on this machine
    memory.last_before = MemoryWork(ms=2.5, maps=1, pages_mapped=16, reclaims=1, reclaim_ms=2.0)
    stats["device_allocs"] += 2
    stats["device_frees"] += 1
    log.record(_record(100.5, 230.0, 40, prefill=512, beside=1024), 100.0, 2 << 30, 1 << 30)
    memory.last_before = MemoryWork()
    memory.last_after = MemoryWork(ms=0.4, pages_unmapped=32, budget_changes=1)
    log.record(_record(100.8, 14.0, 41), 100.0, 3 << 30, 1 << 30)
    log.record(_record(100.9, 99.0, 0), 100.0, 3 << 30, 1 << 30)  # no step: not among slowest
    first, second, idle = (dict(zip(ITERATION_COLUMNS, r, strict=True)) for r in log.rows)
    assert first["t_ms"] == 500.0 and first["quantum_beside_tokens"] == 1024
    assert first["quantum_launched_tokens"] == 0 and second["quantum_launched_tokens"] == 1024
    assert (first["before_maps"], first["before_pages_mapped"], first["before_reclaims"]) == (
        1,
        16,
        1,
    )
    assert first["before_reclaim_ms"] == 2.0 and first["after_ms"] == 0.0
    assert (first["launch_ms"], first["wait_ms"]) == (2.0, 200.0)
    assert (first["device_allocs"], first["device_frees"], first["sync_all_streams"]) == (2, 1, 0)
    assert (first["segments"], first["reserved_gib"], first["lent_gib"]) == (3, 1.0, 2.0)
    assert first["host_allocs"] is None and second["device_allocs"] == 0
    assert second["after_pages_unmapped"] == 32 and second["after_budget_changes"] == 1
    assert idle["launch_ms"] is None and idle["kv_used_blocks"] == 7
    slowest = log.slowest(2)
    assert [row["iteration_ms"] for row in slowest] == [230.0, 14.0]
    assert slowest[0]["reclaims"] == 1 and slowest[0]["before_ms"] == 2.5
    assert slowest[0]["wait_ms"] == 200.0 and slowest[0]["quantum_beside_tokens"] == 1024


def test_iteration_rows_without_allocator_stats_leave_those_columns_empty() -> None:
    memory, engine = _fake_phase(None)
    log = IterationLog(memory, engine, cuda=False)
    log.record(_record(1.0, 5.0, 2), 1.0, 0, 0)
    (row,) = log.rows
    assert len(row) == len(ITERATION_COLUMNS)
    assert row[ITERATION_COLUMNS.index("segments") :] == [None] * 7
    reader = _host_allocs_reader()  # CUDA runs read the pinned allocator's count with it
    assert reader is None or reader() >= 0


def test_phases_run_in_the_order_given() -> None:
    assert parse_phases("static_split,unified") == ["static_split", "unified"]
    assert parse_phases(" unified , decode_only") == ["unified", "decode_only"]
    # a phase given again runs again (bench/memory/args.py labels it; test_memory_repeats.py)
    assert parse_phases("unified,static_split,unified") == ["unified", "static_split", "unified"]
    with pytest.raises(ValueError, match="unknown"):
        parse_phases("unified,static")
    with pytest.raises(ValueError, match="no phase"):
        parse_phases(",")


def test_static_splits_share_is_unifieds_peak_else_the_given_else_decode_alones() -> None:
    cuda = SimpleNamespace(type="cuda")
    plan = {"pool_gib": {"static_split": 29.0}, "cpu_page_bytes": 0}
    args = SimpleNamespace(pool_gib=56.0, reserve_low_pages=768, static_kv_peak_blocks=None)
    unified = {"policy": "unified", "kv_peak_pages": 8844}
    alone = {"policy": "decode_only", "kv_peak_blocks": 7638}
    # M2: unified's 8844 pages + 768, up to whole 16-page map units
    assert _static_decode_pages(args, cuda, plan, [alone, unified]) == 9616
    given = SimpleNamespace(**{**vars(args), "static_kv_peak_blocks": 8844})
    assert _static_decode_pages(given, cuda, plan, [alone]) == 9616  # run before unified
    assert _static_decode_pages(args, cuda, plan, [alone]) == 8416  # decode alone's 7638
    assert _static_decode_pages(args, cuda, plan, []) == 8912  # 60% of 29 GiB, 16-page units
    huge = SimpleNamespace(**{**vars(args), "static_kv_peak_blocks": 10**6})
    assert _static_decode_pages(huge, cuda, plan, []) == 29 * 512 - 16  # below the tail


def _shapes(*examples: int) -> list[QuantumShape]:
    return [QuantumShape(n) for n in examples]


def test_warm_up_captures_each_power_of_two_that_fits() -> None:
    # 1 MiB per token, 100 tokens per example, nothing resident, safety 0.9 (no recomputation
    # offered: the plan's shapes are those without).
    sizing = QuantumSizing(0, float(MIB), max_examples=8)
    assert sizing.warm_plan(50 * MIB, 100)[1] == []  # 45 MiB of room: not one example
    assert sizing.warm_plan(120 * MIB, 100)[1] == _shapes(1)
    assert sizing.warm_plan(500 * MIB, 100)[1] == _shapes(1, 2, 4)  # 4.5 examples fit
    assert sizing.warm_plan(10_000 * MIB, 100)[1] == _shapes(1, 2, 4, 8)  # capped at 8


def test_a_captured_shape_runs_when_what_its_capture_left_held_fits_the_plan() -> None:
    # 1 MiB per token, 100 tokens per example, nothing resident, safety 0.9: the estimate
    # asks 223 MiB for 2 examples; the capture of 1 and 2 examples left 190 MiB held.
    one, two, four = _shapes(1, 2, 4)
    sizing = QuantumSizing(0, float(MIB), max_examples=4)
    assert sizing.choose(200 * MIB, 100) == one  # the estimate alone: 1 example
    sizing.record_capture(two, 190 * MIB)
    sizing.record_capture(one, 190 * MIB)
    assert sizing.choose(200 * MIB, 100, captured={one, two}) == two
    assert sizing.choose(190 * MIB, 100, captured={one, two}) == two
    assert sizing.choose(180 * MIB, 100, captured={one, two}) == one  # not held within it
    assert sizing.choose(200 * MIB, 100, captured={one}) == one  # graphs dropped: estimate
    assert sizing.choose(200 * MIB, 100, captured=set()) == one
    assert sizing.choose(500 * MIB, 100, captured={one, two}) == four  # the estimate is larger
    assert QuantumSizing(0, float(MIB), max_examples=2).choose(50 * MIB, 100) is None
    capped = QuantumSizing(0, float(MIB), max_examples=2)
    capped.footprints[four] = 10 * MIB
    assert capped.choose(50 * MIB, 100, captured={four}) is None  # above max_examples
    # with recomputation offered (a quarter of the bytes per token): below one example
    # without it, the largest with it
    both = QuantumSizing(0, float(MIB), max_examples=4, recompute_bytes_per_token=MIB / 4)
    assert both.choose(100 * MIB, 100) == QuantumShape(2, recompute=True)
    assert both.choose(112 * MIB, 100) == one


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
def test_five_phases_run_end_to_end_on_the_tiny_model(tmp_path: Path) -> None:
    run = run_tiny_trace(
        tmp_path,
        "--job-pool-extra-gib=1",
        # static_split before unified: its share from decode alone's KV peak
        # (unified_release last: no CUDA graphs on CPU, so it runs as unified, with the hooks)
        "--phases=decode_only,decode_only_split,static_split,unified,unified_release",
    )
    result = run.result
    rows = {row["policy"]: row for row in result["rows"]}
    order = ["decode_only", "decode_only_split", "static_split", "unified", "unified_release"]
    assert list(rows) == order
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
    assert result["config"]["phases"] == ",".join(order)
    assert result["config"]["max_batched_tokens"] == 512 and result["config"]["mixed_graphs"]
    assert rows["unified"]["engine"]["max_num_batched_tokens"] == 512
    # the job phases' pool from decode_only's KV peak, capped at --pool-gib
    assert result["config"]["pool_gib_per_phase"] == {
        "unified": 0.05,
        "static_split": 0.05,
        "unified_release": 0.05,
    }
    # static_split ran first: decode alone's KV peak (one block a page on CPU) + the reserve
    peak = rows["decode_only"]["kv_peak_blocks"]
    assert result["config"]["static_decode_pages"] == peak + 16
    # unified_release: the warm-up read the release plan; no graphs on CPU, nothing released
    release = rows["unified_release"]
    assert release["graph_releases"] == 0 and release["finetune_warmup"]["release_plan_gib"] > 0
    assert "finetune_tokens_per_s_ratio_unified_release_over_unified" in result["comparisons"]
    equal = result["comparisons"]["equal_batch"]  # per iteration at equal batch, vs static
    assert set(equal) == {
        f"{name}_over_static_split"
        for name in ("decode_only", "decode_only_split", "unified", "unified_release")
    }
    assert set(equal["unified_over_static_split"]) == {"iteration_ms", "step_ms", "wait_ms"}
    last = run.stdout.strip().splitlines()
    assert last[-1].startswith("wrote ") and last[-2].startswith("unified")
    # One row per loop iteration of every phase, beside the result.
    table = json.loads(run.path.with_suffix(".iterations.json").read_text())
    assert table["columns"] == list(ITERATION_COLUMNS)
    assert list(table["phases"]) == order
    column = {name: i for i, name in enumerate(ITERATION_COLUMNS)}
    for policy, iterations in table["phases"].items():
        assert len(iterations) == rows[policy]["iterations"]
        assert all(len(r) == len(ITERATION_COLUMNS) for r in iterations)
        assert all(r[column["segments"]] is None for r in iterations)  # no allocator on CPU
        times = [r[column["t_ms"]] for r in iterations]
        assert times == sorted(times)
    unified = table["phases"]["unified"]
    assert sum(r[column["quantum_launched_tokens"]] for r in unified) > 0
    changes = [
        r[column["before_budget_changes"]] + r[column["after_budget_changes"]] for r in unified
    ]
    assert any(changes) and sum(r[column["before_pages_mapped"]] for r in unified) > 0
    reclaims = [r[column["before_reclaims"]] + r[column["after_reclaims"]] for r in unified]
    assert sum(reclaims) == rows["unified"]["reclaims"] > 0
