"""The result of `bench/memory.py trace`: the file written after each phase
(`write_trace_result`), the ratios between phases (`trace_comparisons`) and the table printed
last (`print_trace_table`)."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from bench.provenance import commit_hash


def write_trace_result(
    path: Path,
    args: Any,
    spec: Any,
    plan: dict[str, Any],
    rows: list[dict[str, Any]],
    gpu: str,
    today: dt.datetime,
    wall: float,
    iterations: dict[str, list[list[Any]]] | None = None,
) -> None:
    """The result file at `path`, and with `iterations` (phase -> rows of
    `ITERATION_COLUMNS`) the iterations beside it (`iterations_path`)."""
    import torch

    from bench.memory_equal_batch import compare_phases
    from bench.memory_iterations import ITERATION_COLUMNS

    comparisons = trace_comparisons(rows)
    if iterations is not None and "static_split" in iterations:
        phases = {
            name: [dict(zip(ITERATION_COLUMNS, row, strict=True)) for row in table]
            for name, table in iterations.items()
        }
        comparisons["equal_batch"] = compare_phases(phases)  # bench/memory_equal_batch.py
    result = {
        "name": "memory",
        "commit": commit_hash(),
        "gpu": gpu,
        "torch": torch.__version__,
        "created": today.isoformat(timespec="seconds"),
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "trace": spec.as_dict(),
            "finetune": {
                "lora_rank": 16,
                "alpha": 32,
                "seq_len": args.ft_seq_len,
                "resident_bytes": plan["resident_bytes"],
                "bytes_per_token": plan["bytes_per_token"],
                "recompute_bytes_per_token": plan.get("recompute_bytes_per_token"),
                "recompute": plan.get("recompute", "never"),
                "footprint_error": plan["footprint_error"],
                "cuda_graphs": not args.ft_eager,
            },
            "static_decode_pages": plan["static_decode_pages"],
            "plan_headroom_min_pages": plan["plan_headroom_min_pages"],
            "plan_peak_window": plan["plan_peak_window"],
            "plan_peak_prior_blocks": plan.get("plan_peak_prior_blocks", 0),
            "pool_gib_per_phase": plan.get("pool_gib", {}),
            "sharing": plan["sharing"],
        },
        "rows": rows,
        "comparisons": comparisons,
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    path.write_text(json.dumps(result, indent=1, default=str))
    if iterations is not None:
        table = {"columns": ITERATION_COLUMNS, "phases": iterations}
        iterations_path(path).write_text(json.dumps(table, separators=(",", ":")))


def iterations_path(path: Path) -> Path:
    """`memory-h200-20261130.json` -> `memory-h200-20261130.iterations.json`."""
    return path.with_suffix(".iterations.json")


def trace_comparisons(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios between the phases of one run: reclaim p99 over decode iteration p50 (unified);
    finetune memory and tokens/s unified over static;
    decode iteration time (p50, p99, iterations without prefill) of each co-located phase over
    the other and over decode alone; and whether the p50s' 95% intervals overlap (a difference
    within noise)."""
    by_policy = {row["policy"]: row for row in rows if "error" not in row}
    out: dict[str, Any] = {}
    for name in ("unified", "unified_no_peak", "unified_release"):
        row = by_policy.get(name)
        if row is not None:  # the target: a reclaim fits within one decode iteration
            out[f"reclaim_ms_p99_over_decode_iter_ms_p50_{name}"] = _ratio(
                row.get("reclaim_ms_p99"), row.get("decode_iter_ms_p50")
            )
    pairs = (
        ("unified", "static_split"),
        ("unified_no_peak", "static_split"),
        ("unified", "unified_no_peak"),
        ("unified_release", "static_split"),
        ("unified_release", "unified"),
        ("unified_release", "decode_only_split"),
        ("unified", "decode_only"),
        ("static_split", "decode_only"),
        ("unified", "decode_only_split"),
        ("static_split", "decode_only_split"),
        ("decode_only_split", "decode_only"),
    )
    for a, b in pairs:
        first, second = by_policy.get(a), by_policy.get(b)
        if first is None or second is None:
            continue
        keys = ["decode_iter_ms_p50", "decode_iter_ms_p99", "pure_decode_iter_ms_p50"]
        if b in ("static_split", "unified_no_peak", "unified"):
            keys = ["mean_borrowed_gb", "finetune_tokens_per_s", *keys]
        for key in keys:
            out[f"{key}_ratio_{a}_over_{b}"] = _ratio(first.get(key), second.get(key))
        out[f"decode_iter_ms_p50_ci95_overlap_{a}_{b}"] = _overlap(
            first.get("decode_iter_ms_p50_ci95"), second.get("decode_iter_ms_p50_ci95")
        )
    return out


def _overlap(a: list[float | None] | None, b: list[float | None] | None) -> bool | None:
    if not a or not b or None in a or None in b:
        return None
    return bool(a[0] <= b[1] and b[0] <= a[1])  # type: ignore[operator]


def print_trace_table(rows: list[dict[str, Any]]) -> None:
    keys = (
        "ooms",
        "dropped_requests",
        "unfinished_at_end",
        "reclaim_ms_p50",
        "reclaim_ms_p99",
        "finetune_flushes",
        "decode_iter_ms_p50",
        "decode_iter_ms_p99",
        "pure_decode_iter_ms_p50",
        "tpot_ms_p50",
        "kv_peak_gb",
        "mean_borrowed_gb",
        "finetune_tokens_per_s",
        "finetune_quanta",
        "finetune_recompute_quanta",
    )
    print(f"{'policy':16}" + "".join(f"{k[:18]:>19}" for k in keys))
    for row in rows:
        if "error" in row:
            print(f"{row['policy']:16} FAILED {row['error']}", flush=True)
            continue
        cells = [row.get(k) for k in keys]
        text = ["-" if c is None else f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells]
        print(f"{row['policy']:16}" + "".join(f"{t:>19}" for t in text), flush=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
