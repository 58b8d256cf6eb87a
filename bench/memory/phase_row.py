"""The result row of one phase of `python -m bench.memory trace` (`phase_row`: OOMs, dropped
requests, reclaims, decode iteration time with a 95% interval, TPOT, finetune memory and
tokens/s) and the statistics it uses."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any

from gpu_runtime.contract.statistics import percentile

GIB = 1 << 30


def phase_row(phase: Any, *, arrived: int, window: float) -> dict[str, Any]:
    """The result row of one phase after its drive (`_Phase` in bench/memory/phase.py): what
    `arrived` requests of the trace did over `window` seconds."""
    records = phase.records
    live = getattr(phase.engine.scheduler, "requests", {})
    unfinished = len(live)
    counters = phase.memory.manager.counters
    layout = phase.memory.manager.layout
    with_decode = [r for r in records if r.decode_batch or r.prefill_tokens]
    iter_ms = sorted(r.iteration_ms for r in with_decode)
    pure_decode_ms = sorted(r.iteration_ms for r in with_decode if not r.prefill_tokens)
    slowest = phase.log.slowest(8)
    ci_low, ci_high = median_ci(iter_ms)
    tpot = sorted(s for r in records for s in r.tpot_samples_ms)
    reports = [q for r in records for q in r.quanta]
    good = [q for q in reports if not q.error]
    finished = sum(len(r.finished) for r in records)
    lent = phase.lent_samples
    span = lent[-1][0] - lent[0][0] if len(lent) > 1 else 0.0

    def time_mean_gb(column: int) -> float:
        if not span:
            return 0.0
        weighted = sum(a[column] * (b[0] - a[0]) for a, b in itertools.pairwise(lent))
        return weighted / span / 1e9

    accepted = arrived - phase.rejected

    return {
        "model": phase.args.model,
        "engine": engine_record(phase.engine.config),
        "trace": "memory-bursty",
        "policy": phase.name,
        "ooms": phase.ooms,
        "dropped_requests": phase.rejected + max(accepted - finished - unfinished, 0),
        "rejected_requests": phase.rejected,
        "arrived_requests": arrived,
        "finished_requests": finished,
        "unfinished_at_end": unfinished,
        "reclaim_ms_p50": finite(counters.reclaim_latency.percentile_ms(50)),
        "reclaim_ms_p99": finite(counters.reclaim_latency.percentile_ms(99)),
        "reclaims": len(counters.reclaim_latency),
        "flush_ms_p99": finite(counters.flush_latency.percentile_ms(99)),
        "finetune_flushes": len(counters.flush_latency),
        "finetune_waits": counters.finetune_waits,
        "finetune_wait_ms_p99": finite(counters.wait_latency.percentile_ms(99)),
        "decode_iter_ms_p50": percentile(iter_ms, 50),
        "decode_iter_ms_p50_ci95": [finite(ci_low), finite(ci_high)],
        "decode_iter_ms_p99": percentile(iter_ms, 99),
        "decode_iter_ms_mean": finite(sum(iter_ms) / len(iter_ms)) if iter_ms else None,
        # iterations with no prefill chunk (decode tokens only)
        "pure_decode_iter_ms_p50": percentile(pure_decode_ms, 50),
        "pure_decode_iter_ms_p99": percentile(pure_decode_ms, 99),
        "pure_decode_iterations": len(pure_decode_ms),
        "decode_batch_mean": (
            sum(r.decode_batch for r in with_decode) / len(with_decode) if with_decode else 0
        ),
        "slowest_iterations": slowest,
        "decode_step_ms_p50": percentile([r.observed_ms for r in with_decode], 50),
        # Does a quantum on the worker thread hold the decode step up? (same phase, load)
        "decode_step_ms_p50_quantum_beside": percentile(
            [r.observed_ms for r in with_decode if r.in_flight], 50
        ),
        "decode_step_ms_p50_alone": percentile(
            [r.observed_ms for r in with_decode if not r.in_flight], 50
        ),
        "decode_iterations_alone": sum(1 for r in with_decode if not r.in_flight),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
        "mean_borrowed_gb": time_mean_gb(1),
        "max_borrowed_gb": max((row[1] for row in lent), default=0) / 1e9,
        # the budget less the headroom kept for decode's expected reclaims
        "mean_planned_gb": time_mean_gb(2),
        "mean_finetune_reserved_gb": time_mean_gb(3),
        "max_finetune_reserved_gb": max((row[3] for row in lent), default=0) / 1e9,
        "busy_reclaims": counters.busy_reclaims,
        "urgent_flushes": counters.urgent_flushes,
        "graph_releases": counters.graph_releases,
        "deferred_flushes": counters.deferred_flushes,
        "flush_release_ms_p99": finite(counters.flush_release_latency.percentile_ms(99)),
        "finetune_accounting": getattr(
            phase.memory.manager.pool.backend, "finetune_accounting", "simulated"
        ),
        "finetune_tokens_per_s": sum(q.tokens for q in good) / window,
        "finetune_quanta": len(reports),
        "finetune_tokens_per_quantum_mean": (
            sum(q.tokens for q in good) / len(good) if good else 0.0
        ),
        "finetune_quantum_ms_p50": percentile([q.duration_ms for q in good], 50),
        # tokens per quantum -> quanta (which shapes ran, how often)
        "finetune_quantum_tokens": {
            str(k): v for k, v in sorted(Counter(q.tokens for q in good).items())
        },
        # shape ("2": 2 examples, "1r": 1 with recomputation) -> what its capture left held
        "finetune_footprints_gib": {
            k.label: round(v / GIB, 2)
            for k, v in sorted(phase.sizing.footprints.items(), key=lambda kv: kv[0].rank)
        },
        # the shapes the policy launched in the window, and the micro-batches that recomputed
        # activations (the trainer's count)
        "finetune_quantum_shapes": dict(phase.sizing.launched),
        "finetune_recompute_quanta": phase.recompute_quanta(),
        "finetune_paused_iterations": sum(1 for r in records if r.paused),
        "finetune_errors": phase.errors,
        "finetune_graphs": phase.graph_state(),
        "finetune_warmup": phase.warmup,
        "oom_details": phase.oom_details,
        "finetune_budget_violations": counters.finetune_budget_violations,
        "kv_peak_gb": phase.kv_peak_blocks * layout.block_bytes / 1e9,
        "kv_peak_pages": layout.pages_for_blocks(phase.kv_peak_blocks),
        "kv_peak_blocks": phase.kv_peak_blocks,
        "decode_preemptions": counters.preemptions,
        "preemptions_of_unfinished": sum(getattr(r, "num_preemptions", 0) for r in live.values()),
        "window_s": window,
        "iterations": len(records),
        "decode_iterations": len(with_decode),
        "counters": {k: finite(v) for k, v in counters.as_dict().items()},
        "series_t_lent_gib_ft_alloc_gib_kv_gib": phase.series,
    }


def finite(value: float) -> float | None:
    """JSON has no NaN: an empty statistic is null."""
    return None if value != value else value


def median_ci(sorted_values: list[float], z: float = 1.96) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median of `sorted_values`: the order
    statistics at ranks n/2 -/+ z*sqrt(n)/2 (normal approximation of the binomial). Two
    phases' medians differ beyond noise when their intervals do not overlap. NaN for fewer
    than 6 values (no interval at that size)."""
    n = len(sorted_values)
    if n < 6:
        return float("nan"), float("nan")
    half = z * math.sqrt(n) / 2
    low = max(int(math.floor(n / 2 - half)), 0)
    high = min(int(math.ceil(n / 2 + half)), n - 1)
    return sorted_values[low], sorted_values[high]


def engine_record(config: Any) -> dict[str, Any]:
    """The decode engine's step shape: token budget, mixed-step graphs, chunk attention."""
    mixed = bool(config.mixed_cuda_graphs)
    return {
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "mixed_cuda_graphs": mixed,
        "mixed_graph_token_sizes": list(config.mixed_graph_token_sizes()) if mixed else None,
        "chunk_attention": config.chunk_attention,
        "max_num_seqs": config.max_num_seqs,
    }
