"""The timed runs of ``bench/colocate/run.py`` and the result they are written to: one policy on one
trace (`Runs.run`), every fixed split swept for the static baseline (`Runs.sweep_static`), and
the result document rewritten after each run (`Runs.write`: ``colocate-<gpu>-<yyyymmdd>.json``
and every run's iterations beside it, in ``.iterations.json``)."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.colocate.backends import Backend, LoopBackend
from bench.colocate.calibrate import make_policy
from bench.colocate.report import POLICIES, Run, compare, definitions, iterations_document, row_for
from bench.common.gpu_state import gpu_state
from bench.common.provenance import commit_hash
from bench.common.traces import TraceRequest, TraceSpec
from gpu_runtime.colocation import IterationRecord
from gpu_runtime.colocation.corrected import CorrectedLatencyModel
from gpu_runtime.colocation.harli import HarliConfig
from gpu_runtime.colocation.latency_model import DecodeLatencyModel


@dataclass
class Runs:
    """Every timed run of one benchmark, and what its result document says about them.

    ``slo_ms`` judges the runs: 1e9 until ``main`` has set the SLO from decode_only's runs.
    ``info`` is the configuration ``main`` keeps adding to; each `write` takes it as it stands.
    """

    args: argparse.Namespace
    backend: Backend
    specs: dict[str, TraceSpec]
    """Each trace's spec, by name."""
    trace_reqs: dict[str, list[TraceRequest]]
    """Each trace's requests (identical for every policy)."""
    traces: list[str]
    """The traces in the order of the result's rows."""
    harli_latency: DecodeLatencyModel
    """The latency model harli and time_slice plan with."""
    harli_config: HarliConfig
    calib_records: list[IterationRecord]
    """The calibration phase's iterations (harli's quantum durations are seeded from them)."""
    solo_tps: float
    """Solo finetune tokens/s (8 examples), the rows' solo fraction is against it."""
    rank: int
    """The LoRA job's rank."""
    info: dict[str, Any]
    gpu: str
    """The result's ``gpu``, in words."""
    created: datetime.datetime
    path: Path
    """The result file; the iterations are beside it."""
    wall: float
    """``time.perf_counter()`` at the benchmark's start (the budget counts from it)."""
    slo_ms: float = 1e9
    results: dict[tuple[str, str], Run] = field(default_factory=dict)
    """Each (trace, policy)'s run; static_split's is the best of its sweep."""
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    slo_parts: dict[str, float] = field(default_factory=dict)
    static_by_trace: dict[str, int | None] = field(default_factory=dict)
    sweeps: dict[tuple[str, int], tuple[dict[str, Any], Run]] = field(default_factory=dict)
    """Each (trace, decode SMs) of static_split's sweep: its row and its run."""
    states: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """GPU state around each run, by (trace, label)."""
    static_sweep: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    @property
    def iterations_path(self) -> Path:
        """Every run's iterations, beside the result."""
        return self.path.with_suffix(".iterations.json")

    def run(self, trace: str, name: str, static_d: int | None = None) -> dict[str, Any] | None:
        """One policy on one trace; its row (None when skipped or failed). ``static_d``: the
        static split's decode SMs (default: the one chosen for the trace)."""
        args, backend, specs = self.args, self.backend, self.specs
        label = name if name != "static_split" or static_d is None else f"{name}@{static_d}"
        if (
            time.perf_counter() - self.wall + specs[trace].duration_s + args.drain_s + 1
            > args.budget_s
        ):
            self.skipped.append(f"{trace}/{label}")
            return None
        # What earlier runs left (their records) is long-lived: out of the collector's full
        # passes, which would walk it at a random iteration of this run (engine README).
        gc.freeze()
        before = gpu_state()
        try:
            policy = make_policy(
                name,
                self.harli_latency,
                self.static_by_trace.get(trace) if static_d is None else static_d,
                self.harli_config,
                self.calib_records,
            )
            records, start, end = backend.run(
                policy,
                self.trace_reqs[trace],
                specs[trace].duration_s,
                self.slo_ms,
                name != "decode_only",
                drain_s=args.drain_s,
            )
        except Exception as exc:  # one failing run must not cost the others' results
            self.failed[f"{trace}/{label}"] = f"{type(exc).__name__}: {exc}"
            print(f"  {trace:7s} {label:12s} FAILED {self.failed[f'{trace}/{label}']}", flush=True)
            traceback.print_exc()
            return None
        running = list(backend.last_running)
        window = specs[trace].duration_s  # finetune tokens/s over the arrivals only
        r = row_for(
            args.model,
            trace,
            policy,
            records,
            start,
            end,
            self.slo_ms,
            self.solo_tps,
            running,
            window,
        )
        self.states[trace, label] = {"before": before, "after": gpu_state()}
        r["gpu_state"] = self.states[trace, label]
        if r["quantum_errors"]:
            print(f"  QUANTUM ERRORS {trace}/{label}: {r['first_quantum_error']}", flush=True)
        print(
            f"  {trace:7s} {label:12s} att={r['slo_attainment']} "
            f"ft={r['finetune_tokens_per_s']} p50={r['tpot_ms_p50']} p99={r['tpot_ms_p99']} "
            f"t={time.perf_counter() - self.wall:.0f}s",
            flush=True,
        )
        if static_d is None:
            self.results[trace, name] = (policy, records, start, end, running)
        else:
            self.sweeps[trace, static_d] = (r, (policy, records, start, end, running))
        return r

    def sweep_static(self, trace: str) -> None:
        """Every fixed split on ``trace``; the static split's row is the best of them: the
        most finetune tokens/s among those keeping >= 99% attainment, else the best
        attainment (the best fixed split, chosen with hindsight of this very trace)."""
        rows = {
            d: r
            for d in self.backend.choices[:-1]
            if (r := self.run(trace, "static_split", static_d=int(d))) is not None
        }
        if not rows:
            return
        keeping = {d: r for d, r in rows.items() if (r["slo_attainment"] or 0) >= 0.99}
        if keeping:
            best = max(keeping, key=lambda d: keeping[d]["finetune_tokens_per_s"])
        else:
            best = max(rows, key=lambda d: rows[d]["slo_attainment"] or 0)
        self.static_by_trace[trace] = best
        self.results[trace, "static_split"] = self.sweeps[trace, best][1]
        self.static_sweep[trace] = {
            str(d): {
                "slo_attainment": r["slo_attainment"],
                "finetune_tokens_per_s": r["finetune_tokens_per_s"],
                "request_tpot_ms_p99": r["request_tpot_ms_p99"],
            }
            for d, r in rows.items()
        }

    def write(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Write the result and the iterations beside it as they stand; (rows, comparisons)."""
        args, backend, specs, traces = self.args, self.backend, self.specs, self.traces
        rows = []
        for (t, name), (pol, recs, s, e, run) in self.results.items():
            row = row_for(
                args.model, t, pol, recs, s, e, self.slo_ms, self.solo_tps, run, specs[t].duration_s
            )
            swept = (t, f"{name}@{self.static_by_trace.get(t)}")  # static_split's best in a sweep
            row["gpu_state"] = self.states.get(swept) or self.states.get((t, name))
            rows.append(row)
        rows.sort(key=lambda r: (traces.index(r["trace"]), POLICIES.index(r["policy"])))
        comparisons = compare(rows, traces)
        result = {
            "name": "colocate",
            "commit": args.commit or commit_hash(),
            "gpu": self.gpu,
            "torch": torch.__version__,
            "created": self.created.isoformat(timespec="seconds"),
            "config": {
                **{k: v for k, v in vars(args).items() if k != "out"},
                "traces": {t: s.as_dict() for t, s in specs.items()},
                **self.info,
                "finetune": {
                    "lora_rank": self.rank,
                    "alpha": 32,
                    "dropout": args.ft_dropout,
                    "seq_len": args.ft_seq_len,
                    "optimizer_batch": 8,
                },
                "tpot_slo_ms": self.slo_ms,
                **definitions(args),
                "slo_parts_ms": self.slo_parts,
                "static_split_decode_sms": self.static_by_trace,
                "static_split_sweep": self.static_sweep,
                "harli_config": asdict(self.harli_config),
                "skipped_runs": self.skipped,
                "failed_runs": self.failed,
                "data_stream_restarts": getattr(backend, "stream_restarts", 0),
                "graph_state_end": (
                    backend.graph_state() if isinstance(backend, LoopBackend) else None
                ),
                "harli_correction_end": (
                    self.harli_latency.describe()
                    if isinstance(self.harli_latency, CorrectedLatencyModel)
                    else None
                ),
            },
            "simulated": bool(args.simulate),
            "rows": rows,
            "comparisons": comparisons,
            "wall_s": round(time.perf_counter() - self.wall, 1),
        }
        self.path.write_text(json.dumps(result, indent=1, default=str))
        self.iterations_path.write_text(json.dumps(iterations_document(self.results, self.sweeps)))
        return rows, comparisons
