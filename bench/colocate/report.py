"""Results of ``bench/colocate/run.py``: one row per (trace, policy) run (`row_for`: attainment per
request, TPOT percentiles over token gaps, finetune tokens/s, goodput, plan notes), Harli
against the best baseline (`compare`) and the table printed last (`print_table`)."""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from typing import Any

from gpu_runtime.colocation import (
    CoLocationPolicy,
    IterationRecord,
    summarize,
)
from gpu_runtime.colocation.types import FinishedRequest, LaunchMode
from gpu_runtime.contract.statistics import percentile

POLICIES = ("decode_only", "naive", "time_slice", "static_split", "harli")
BASELINES = ("naive", "time_slice", "static_split")


def decision_counts(records: list[IterationRecord], top: int = 8) -> dict[str, int]:
    """How often each kind of plan note occurred (numbers in notes dropped)."""
    notes: dict[str, int] = {}
    for r in records:
        key = r.note.split(" (")[0]
        notes[key] = notes.get(key, 0) + 1
    return dict(sorted(notes.items(), key=lambda kv: -kv[1])[:top])


def launch_iteration_stats(records: list[IterationRecord]) -> dict[str, float | int | None]:
    """What launching a concurrent quantum adds to a token gap: the time of decode iterations
    without a prefill chunk (plan time left out) that launched one, against those beside a
    quantum already in flight (p50 / p90 / max, ms; None without such iterations). Launched
    before the step, the launch's host work is in the first; from inside it (the default), it
    overlaps the step."""

    def gap(r: IterationRecord) -> float:
        return r.iteration_ms - r.plan_ms

    decode = [r for r in records if r.decode_batch and not r.prefill_tokens]
    launched = [
        gap(r)
        for r in decode
        if any(launch.mode is LaunchMode.CONCURRENT for launch in r.finetune_launched)
    ]
    beside = [gap(r) for r in decode if r.in_flight and not r.finetune_launched]
    return {
        "launch_iterations": len(launched),
        "launch_iteration_ms_p50": percentile(launched, 50),
        "launch_iteration_ms_p90": percentile(launched, 90),
        "launch_iteration_ms_max": round(max(launched), 3) if launched else None,
        "in_flight_iteration_ms_p50": percentile(beside, 50),
        "in_flight_iteration_ms_p90": percentile(beside, 90),
    }


def request_tpots(records: list[IterationRecord], running: list[FinishedRequest]) -> list[float]:
    """Mean TPOT of every request finished in the window or still running (>= 16 tokens)."""
    out = [f.tpot_ms for r in records for f in r.finished if f.tpot_ms is not None]
    return out + [f.tpot_ms for f in running if f.tpot_ms is not None]


def definitions(args: argparse.Namespace) -> dict[str, str]:
    """What the result's SLO, attainment and static split mean, in words, for ``args``."""
    return {
        "slo_definition": (
            f"fixed at {args.tpot_slo_ms} ms (--tpot-slo-ms); the rule's parts recorded beside"
            if getattr(args, "tpot_slo_ms", None) is not None
            else f"{args.slo_factor} x decode_only TPOT p50 on the medium trace"
            + (
                f", raised to {args.slo_headroom} x the slowest request TPOT of "
                "decode_only over the traces (an SLO decode alone meets on every trace)"
                if args.slo_rule == "attainable"
                else ""
            )
        ),
        "attainment_definition": "share of requests whose mean TPOT <= SLO, over every "
        "request of the trace: arrivals for duration s, then the run goes on (same policy, "
        "finetuning included) for up to drain_s until all have finished; one still decoding "
        "then is judged by its TPOT so far if it has >= 16 tokens (unfinished_requests); "
        "finished_slo_attainment counts finished only; goodput = tokens of requests meeting "
        "the SLO per second of the whole run; finetune tokens/s counts quanta completed in "
        "the arrival window (window_seconds)",
        "static_split_selection": (
            "per trace, every fixed split run on the trace; the row is the one with the most "
            "finetune tokens/s among those keeping >= 99% attainment, else the best "
            "attainment (hindsight of the trace: static_split_sweep)"
            if args.static_split == "sweep"
            else "per trace, the smallest split under which >= 99% of decode_only's requests "
            "on that trace keep a predicted mean TPOT (over the iterations they decoded in, a "
            "2-example quantum always beside) <= 0.95 x SLO (else the largest split)"
        ),
    }


def row_for(
    model_name: str,
    trace: str,
    policy: CoLocationPolicy,
    records: list[IterationRecord],
    start: float,
    end: float,
    slo_ms: float,
    solo_tps: float,
    running: list[FinishedRequest],
    window_s: float | None = None,
) -> dict[str, Any]:
    """One policy's row on one trace. TPOTs and attainment cover the whole run (arrivals, then
    the drain until every request has finished); finetune tokens/s covers the arrival window
    (``window_s`` from ``start``; the whole run when None), where decode's load is the trace's,
    not the lighter tail of the drain."""
    m = summarize(records, slo_ms, start=start, end=end)
    window_end = end if window_s is None else min(end, start + window_s)
    in_window = [r for r in records if r.timestamp < window_end]
    w = summarize(in_window, slo_ms, start=start, end=window_end)
    launches = [r for r in records if r.finetune_launched]
    # Attainment over the requests finished in the run and those still decoding at its end
    # with >= 16 tokens (their mean TPOT so far; none when the drain let every request end).
    judged = request_tpots(records, running)
    met = [t for t in judged if t <= slo_ms]
    good_running = sum(f.output_tokens for f in running if (f.tpot_ms or 0) <= slo_ms)
    seconds = max(end - start, 1e-9)
    return {
        "model": model_name,
        "trace": trace,
        "policy": policy.name,
        "tpot_slo_ms": round(slo_ms, 3),
        "slo_attainment": len(met) / len(judged) if judged else None,
        "judged_requests": len(judged),
        "request_tpot_ms_p99": percentile(judged, 99),
        "finished_slo_attainment": m.slo_attainment,
        "token_slo_attainment": m.token_slo_attainment,
        "tpot_ms_p50": m.tpot_ms_p50,
        "tpot_ms_p99": m.tpot_ms_p99,
        "finetune_tokens_per_s": round(w.finetune_tokens_per_s, 1),
        "finetune_tokens_per_s_whole_run": round(m.finetune_tokens_per_s, 1),
        "solo_finetune_tokens_per_s": round(solo_tps, 1),
        "solo_fraction": round(w.finetune_tokens_per_s / solo_tps, 4) if solo_tps else None,
        "goodput_tokens_per_s": round(m.goodput_tokens_per_s + good_running / seconds, 1),
        "decode_tokens_per_s": round(m.decode_tokens_per_s, 1),
        "finished_requests": m.finished_requests,
        "tpot_samples": m.tpot_samples,
        "iterations": m.iterations,
        "paused_iterations": m.paused_iterations,
        "iterations_with_launch": len(launches),
        "decode_sm_share_mean": m.decode_sm_share_mean,
        "prediction_mape": m.prediction_mape,
        "ttft_ms_p50": m.ttft_ms_p50,
        "ttft_ms_p99": m.ttft_ms_p99,
        "seconds": round(end - start, 3),
        "window_seconds": round(window_end - start, 3),
        "unfinished_requests": len(running),
        "decisions": decision_counts(records),
        "margin_mean": (
            round(statistics.mean(margins), 4)
            if (margins := [r.margin for r in records if r.margin is not None])
            else None
        ),
        "quanta": len(quanta := [q for r in records for q in r.quanta]),
        "quantum_ms_p50": percentile([q.duration_ms for q in quanta if q.tokens], 50),
        "quantum_graph_modes": dict(Counter(str(q.graph) for q in quanta)),
        **launch_iteration_stats(records),
        "iteration_ms_p50": percentile([r.iteration_ms for r in records], 50),
        "iteration_ms_p99": percentile([r.iteration_ms for r in records], 99),
        "quantum_errors": len(errors := [q.error for r in records for q in r.quanta if q.error]),
        "first_quantum_error": errors[0] if errors else None,
        "policy_config": policy.describe(),
    }


ITERATION_COLUMNS = (
    "t_ms",
    "decode_batch",
    "prefill_tokens",
    "context_tokens_total",
    "decode_sms",
    "beside_tokens",
    "predicted_ms",
    "iteration_ms",
    "step_ms",
    "plan_ms",
    "margin",
    "paused",
    "note",
)


def iteration_table(records: list[IterationRecord], start: float) -> list[list[Any]]:
    """One row per iteration (``ITERATION_COLUMNS``): what was planned and what it took."""
    return [
        [
            round((r.timestamp - start) * 1e3, 2),
            r.decode_batch,
            r.prefill_tokens,
            r.context_tokens_total,
            r.decode_sms,
            r.beside_tokens,
            None if r.predicted_ms is None else round(r.predicted_ms, 3),
            round(r.iteration_ms, 3),
            round(r.observed_ms, 3),
            round(r.plan_ms, 3),
            None if r.margin is None else round(r.margin, 4),
            r.paused,
            r.note,
        ]
        for r in records
    ]


REQUEST_COLUMNS = ("request_id", "output_tokens", "tpot_ms", "ttft_ms", "finish_reason")


def request_table(
    records: list[IterationRecord], running: list[FinishedRequest]
) -> list[list[Any]]:
    """One row per request of a run (``REQUEST_COLUMNS``): those that finished, then any still
    decoding at its end ("running", TPOT so far): what attainment was judged on."""
    return [
        [
            f.request_id,
            f.output_tokens,
            None if f.tpot_ms is None else round(f.tpot_ms, 3),
            None if f.ttft_ms is None else round(f.ttft_ms, 2),
            f.finish_reason,
        ]
        for f in [*(f for r in records for f in r.finished), *running]
    ]


Run = tuple[CoLocationPolicy, list[IterationRecord], float, float, list[FinishedRequest]]
"""One policy's run on one trace: (policy, records, start, end, requests still running)."""


def iterations_document(
    results: dict[tuple[str, str], Run], sweeps: dict[tuple[str, int], tuple[Any, Run]]
) -> dict[str, Any]:
    """The ``.iterations.json`` beside the result: every run's iterations and requests, keyed
    ``trace/policy`` (the fixed splits swept for static_split as ``trace/static_split@d``)."""
    runs = {f"{t}/{run[0].name}": run for (t, _), run in results.items()}
    runs |= {f"{t}/static_split@{d}": run for (t, d), (_, run) in sweeps.items()}
    return {
        "columns": ITERATION_COLUMNS,
        "runs": {key: iteration_table(run[1], run[2]) for key, run in runs.items()},
        "request_columns": REQUEST_COLUMNS,
        "requests": {key: request_table(run[1], run[4]) for key, run in runs.items()},
    }


def compare(rows: list[dict[str, Any]], traces: list[str]) -> dict[str, Any]:
    """Harli vs the best baseline keeping >= 99% attainment, per trace and averaged."""
    per_trace: dict[str, Any] = {}
    ratios = []
    for trace in traces:
        by = {r["policy"]: r for r in rows if r["trace"] == trace}
        harli = by.get("harli")
        ok = [by[p] for p in BASELINES if p in by and (by[p]["slo_attainment"] or 0) >= 0.99]
        best = max(ok, key=lambda r: r["finetune_tokens_per_s"], default=None)
        entry: dict[str, Any] = {"best_baseline": best["policy"] if best else None}
        if "decode_only" in by:  # what the SLO allows at all on this trace
            entry["decode_only_attainment"] = by["decode_only"]["slo_attainment"]
        if harli is not None:
            entry["harli_meets_99"] = (harli["slo_attainment"] or 0) >= 0.99
            entry["harli_solo_fraction"] = harli["solo_fraction"]
            if best is not None and best["finetune_tokens_per_s"] > 0:
                ratio = harli["finetune_tokens_per_s"] / best["finetune_tokens_per_s"]
                entry["harli_tokens_per_s"] = harli["finetune_tokens_per_s"]
                entry["best_baseline_tokens_per_s"] = best["finetune_tokens_per_s"]
                entry["harli_over_best_baseline"] = round(ratio, 3)
                ratios.append(ratio)
        per_trace[trace] = entry
    mean_ratio = round(statistics.mean(ratios), 3) if ratios else None
    paired = [
        (entry["harli_tokens_per_s"], entry["best_baseline_tokens_per_s"])
        for entry in per_trace.values()
        if "harli_over_best_baseline" in entry
    ]
    base_total = sum(b for _, b in paired)
    low = per_trace.get("low", {}).get("harli_solo_fraction")
    return {
        "per_trace": per_trace,
        "mean_harli_over_best_baseline": mean_ratio,
        "ratio_traces": len(ratios),
        "total_harli_over_best_baseline": (
            round(sum(h for h, _ in paired) / base_total, 3) if base_total > 0 else None
        ),
        "targets": {
            "harli_attainment_ge_0.99_every_trace": all(
                e.get("harli_meets_99") for e in per_trace.values()
            ),
            "mean_over_best_baseline_ge_1.46": mean_ratio is not None and mean_ratio >= 1.46,
            "low_load_solo_fraction_ge_0.6": low is not None and low >= 0.6,
        },
    }


def print_table(rows: list[dict[str, Any]], comparisons: dict[str, Any], slo_ms: float) -> None:
    print(f"\nTPOT SLO {slo_ms:.2f} ms")
    head = (
        f"{'trace':8s} {'policy':13s} {'attain':>7s} {'p50':>7s} {'p99':>7s} "
        f"{'ft tok/s':>9s} {'solo%':>6s} {'goodput':>8s} {'ttft99':>7s}"
    )
    print(head)
    for r in rows:
        att = r["slo_attainment"]
        print(
            f"{r['trace']:8s} {r['policy']:13s} "
            f"{'-' if att is None else f'{att:.3f}':>7s} "
            f"{r['tpot_ms_p50'] or 0:7.2f} {r['tpot_ms_p99'] or 0:7.2f} "
            f"{r['finetune_tokens_per_s']:9.0f} {100 * (r['solo_fraction'] or 0):6.1f} "
            f"{r['goodput_tokens_per_s']:8.0f} {r.get('ttft_ms_p99') or 0:7.1f}"
        )
    for trace, entry in comparisons["per_trace"].items():
        print(f"{trace}: {entry}")
    print(f"mean harli / best baseline (>=99%): {comparisons['mean_harli_over_best_baseline']}")
    print(f"targets: {comparisons['targets']}")
