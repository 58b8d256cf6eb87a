"""The result of `python -m bench.memory trace`: the file written after each phase
(`write_trace_result`), the ratios between phases (`trace_comparisons`) and the table printed
last (`print_trace_table`). Phases are keyed by their label (`unified`, and `unified#2` for its
second run: bench/memory/args.py)."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from bench.common.provenance import commit_hash
from bench.memory.args import JOB_PHASES, occurrence_pairs, occurrences
from bench.memory.equal_batch import WITHIN_NOISE_RULE, compare_phases, has_repeats, noise_lines
from bench.memory.iterations import ITERATION_COLUMNS


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
) -> dict[str, Any]:
    """The result file at `path`, and with `iterations` (phase label -> rows of
    `ITERATION_COLUMNS`) the iterations beside it (`iterations_path`); returns its
    `comparisons`. `config.phase_settings` holds what each run was given (label -> pool GiB,
    peak prior, static_split's decode share: a repeat's equal its first run's); the single
    `config.static_decode_pages` and `config.plan_peak_prior_blocks` are the plan's values as
    the last run left them (a run without repeats: static_split's and the unified phases')."""
    import torch

    comparisons = trace_comparisons(rows)
    if iterations is not None and "static_split" in iterations:
        phases = {
            name: [dict(zip(ITERATION_COLUMNS, row, strict=True)) for row in table]
            for name, table in iterations.items()
        }
        comparisons["equal_batch"] = compare_phases(phases)  # bench/memory/equal_batch.py
        if has_repeats(phases):
            comparisons["equal_batch_within_noise_rule"] = WITHIN_NOISE_RULE
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
            "phase_settings": plan.get("phase_settings", {}),
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
    return comparisons


def iterations_path(path: Path) -> Path:
    """`memory-h200-20261130.json` -> `memory-h200-20261130.iterations.json`."""
    return path.with_suffix(".iterations.json")


def trace_comparisons(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios between the phases of one run: reclaim p99 over decode iteration p50 (unified);
    finetune memory and tokens/s unified over static;
    decode iteration time (p50, p99, iterations without prefill) of each co-located phase over
    the other and over decode alone; and whether the p50s' 95% intervals overlap (a difference
    within noise). With repeats, every pairing of the two phases' runs (`occurrence_pairs`:
    `unified_over_static_split`, `unified#2_over_static_split#2`, ...) and each repeat over
    its phase's first run without error (A/A: `..._ratio_unified#2_over_unified`,
    `decode_iter_ms_p50_ci95_overlap_unified#2_unified`)."""
    by_label = {row["policy"]: row for row in rows if "error" not in row}
    runs = occurrences(by_label)
    out: dict[str, Any] = {}
    for name in ("unified", "unified_no_peak", "unified_release"):
        for label in runs.get(name, []):  # the target: a reclaim fits within one decode iteration
            row = by_label[label]
            out[f"reclaim_ms_p99_over_decode_iter_ms_p50_{label}"] = _ratio(
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
        with_job = b in ("static_split", "unified_no_peak", "unified")
        for first, second in occurrence_pairs(runs.get(a, []), runs.get(b, [])):
            _compare(out, by_label[first], by_label[second], with_job)
    for name, labels in runs.items():
        for label in labels[1:]:
            _compare(out, by_label[label], by_label[labels[0]], name in JOB_PHASES)
    return out


def _compare(out: dict[str, Any], a: dict[str, Any], b: dict[str, Any], with_job: bool) -> None:
    """`a`'s decode iteration times (and with `with_job` finetune memory and tokens/s) over
    `b`'s, and whether their p50 intervals overlap, into `out` under the rows' labels."""
    first, second = a["policy"], b["policy"]
    keys = ["decode_iter_ms_p50", "decode_iter_ms_p99", "pure_decode_iter_ms_p50"]
    if with_job:
        keys = ["mean_borrowed_gb", "finetune_tokens_per_s", *keys]
    for key in keys:
        out[f"{key}_ratio_{first}_over_{second}"] = _ratio(a.get(key), b.get(key))
    out[f"decode_iter_ms_p50_ci95_overlap_{first}_{second}"] = _overlap(
        a.get("decode_iter_ms_p50_ci95"), b.get("decode_iter_ms_p50_ci95")
    )


def _overlap(a: list[float | None] | None, b: list[float | None] | None) -> bool | None:
    if not a or not b or None in a or None in b:
        return None
    return bool(a[0] <= b[1] and b[0] <= a[1])  # type: ignore[operator]


def print_trace_table(
    rows: list[dict[str, Any]], comparisons: dict[str, Any] | None = None
) -> None:
    """One line per run (repeats under their labels); with repeats and `comparisons` (the
    result's), then the same run's A/A spread: each repeat's decode iteration p50 over its
    phase's first run, and the equal-batch figures (`noise_lines`)."""
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
    width = max([16, *(len(row["policy"]) + 1 for row in rows)])
    print(f"{'policy':{width}}" + "".join(f"{k[:18]:>19}" for k in keys))
    for row in rows:
        if "error" in row:
            print(f"{row['policy']:{width}} FAILED {row['error']}", flush=True)
            continue
        cells = [row.get(k) for k in keys]
        text = ["-" if c is None else f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells]
        print(f"{row['policy']:{width}}" + "".join(f"{t:>19}" for t in text), flush=True)
    if comparisons is None:
        return
    runs = occurrences(row["policy"] for row in rows if "error" not in row)
    repeats = [(label, labels[0]) for labels in runs.values() for label in labels[1:]]
    if repeats:
        print("same-run A/A, decode iteration p50 of a repeat over its phase's first run:")
    for label, first in repeats:
        ratio = comparisons.get(f"decode_iter_ms_p50_ratio_{label}_over_{first}")
        overlap = comparisons.get(f"decode_iter_ms_p50_ci95_overlap_{label}_{first}")
        apart = {True: "intervals overlap", False: "intervals apart", None: "-"}[overlap]
        shown = "-" if ratio is None else f"{ratio:.4f}x"
        print(f"  {label} over {first}: {shown} ({apart})", flush=True)
    if repeats and comparisons.get("equal_batch"):
        for line in noise_lines(comparisons["equal_batch"]):
            print(line, flush=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
