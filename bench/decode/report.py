"""Results of ``bench/decode/run.py``: one row per (model, system, batch, context) with its TPOT
percentiles against the HBM floor (`DecodeReport.add_row`), the floor rows and the speedups over
HF derived from them, the result file rewritten after every row (`DecodeReport.write`) and the
table printed last (`print_table`)."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common.provenance import gpu_slug
from bench.common.samples import sample_percentile
from bench.decode.args import Sweep
from bench.decode.bounds import step_bounds
from gpu_runtime.model import ModelConfig

HF_SYSTEMS = ("hf_eager", "hf_compile")
BOUND_KEYS = (
    "floor_bw_ms",
    "step_tflop",
    "floor_compute_ms",
    "floor_serial_ms",
    "floor_roofline_ms",
    "compute_bound_kernels",
)
"""Per-row bounds beside `floor_ms` (see `bench/decode/bounds.py`); also on the floor rows."""
TARGET_SPEEDUP, TARGET_BATCH, TARGET_FRAC = 10.0, 64, 0.8
"""Issue 3: >= 10x HF eager at batch 64; >= 0.8 of the HBM floor at every batch >= 8."""


def weight_bytes_read(config: ModelConfig) -> int:
    """Bytes a decode step reads from weights: everything but the embedding table (only B rows
    of it are read), unless the table is also the LM head."""
    params = config.num_parameters()
    if not config.tie_word_embeddings:
        params -= config.vocab_size * config.hidden_size
    return params * 2


def floor_ms(config: ModelConfig, batch: int, context: float, bandwidth: float) -> float:
    """The HBM floor of a decode step: (weights read once + the batch's KV at `context`) over
    the copy `bandwidth` (bytes/s), in ms."""
    floor_bytes = weight_bytes_read(config) + batch * context * config.kv_bytes_per_token()
    return floor_bytes / bandwidth * 1e3


def with_floor_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` and, after them, a `floor` row beside every `harli` row (TPOT = the floor)."""
    all_rows = list(rows)
    for row in rows:
        if row["system"] == "harli":
            all_rows.append(
                {k: row[k] for k in ("model", "batch", "context", "floor_ms")}
                | {k: row[k] for k in BOUND_KEYS if k in row}
                | {
                    "system": "floor",
                    "tpot_ms_p50": row["floor_ms"],
                    "tpot_ms_p99": row["floor_ms"],
                    "bandwidth_frac": 1.0,
                }
            )
    return all_rows


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of our systems' TPOT p50 (`ours`: ``harli``, ``harli_sync``, ...) over each HF
    row's at the same (model, batch, context)."""
    ratios = []
    for row in rows:
        if row["system"] not in HF_SYSTEMS:
            continue
        for ours in rows:
            if (
                ours["system"].startswith("harli")
                and ours["model"] == row["model"]
                and ours["batch"] == row["batch"]
                and ours["context"] == row["context"]
            ):
                ratios.append(
                    {
                        "model": row["model"],
                        "batch": row["batch"],
                        "context": row["context"],
                        "vs": row["system"],
                        "ours": ours["system"],
                        "speedup": round(row["tpot_ms_p50"] / ours["tpot_ms_p50"], 2),
                    }
                )
    return ratios


def targets(rows: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 3's targets per (model, our system): the speedup over HF eager at batch 64 (every
    context HF ran), and per context the lowest fraction of the HBM floor at batch >= 8 with
    the batches below 0.8 and, there, the per-kernel roofline's fraction of the HBM floor (a
    row whose roofline is far above the HBM floor cannot reach 0.8 with any kernel)."""
    speedup = [
        {k: r[k] for k in ("model", "ours", "context", "speedup")}
        | {"met": r["speedup"] >= TARGET_SPEEDUP}
        for r in ratios
        if r["vs"] == "hf_eager" and r["batch"] == TARGET_BATCH
    ]
    bandwidth = []
    groups = sorted(
        {(r["model"], r["system"], r["context"]) for r in rows if r["system"].startswith("harli")}
    )
    for model, system, context in groups:
        mine = [
            r
            for r in rows
            if (r["model"], r["system"], r["context"]) == (model, system, context)
            and r["batch"] >= 8
        ]
        if not mine:
            continue
        below = [r for r in mine if r["bandwidth_frac"] < TARGET_FRAC]
        bandwidth.append(
            {
                "model": model,
                "ours": system,
                "context": context,
                "min_frac": min(r["bandwidth_frac"] for r in mine),
                "met": not below,
                "below": [
                    {
                        "batch": r["batch"],
                        "frac": r["bandwidth_frac"],
                        "roofline_over_floor": round(r["floor_roofline_ms"] / r["floor_ms"], 3)
                        if "floor_roofline_ms" in r
                        else None,
                    }
                    for r in below
                ],
            }
        )
    return {
        "hf_eager_speedup_b64": speedup,
        "bandwidth_frac_b_ge_8": bandwidth,
        "note": "system 'harli' is the run's first variant (async scheduling by default, as "
        "python -m gpu_runtime.server deploys the engine); 'harli_sync' the engine default",
    }


def run_config(args: argparse.Namespace, sweep: Sweep) -> dict[str, Any]:
    """The result file's `config`: the options as parsed and what TPOT and the floor mean."""
    return {
        "models": sweep.models,
        "batches": sweep.batches,
        "contexts": sweep.contexts,
        "steps": args.steps,
        "warmup": args.warmup,
        "hf_eager_batches": sweep.hf_eager,
        "hf_compile_batches": sweep.hf_compile,
        "hf_compile_models": args.hf_compile_models,
        "hf_context": args.hf_context,
        "hf_steps": args.hf_steps,
        "block_size": 16,
        "dtype": "bfloat16",
        "sampling": "temperature 0.8 (ours); greedy argmax (HF)",
        "fused_decode_kernels": not args.no_fused,
        "decode_blas_library": args.blas,
        "mixed_cuda_graphs": args.mixed_graphs,
        "variants": args.variants,
        "prefill_chunks": sweep.chunks,
        "extras": sweep.extras,
        "tpot": "wall time of Engine.step() incl. scheduling, input copy, graph replay, "
        "sampling and the host sync; graph_replay_ms is the graph alone (CUDA events)",
        "floor": "(weights except embedding table + batch KV at mean context) / copy bandwidth",
        "bounds": "floor_compute_ms = step FLOPs / bf16 dense GEMM throughput measured in the "
        "run (8192^3 matmul); floor_serial_ms = floor_ms + floor_compute_ms (no overlap of "
        "bytes and math); floor_roofline_ms = sum over the step's kernels of max(bytes / copy "
        "bandwidth, FLOPs / GEMM throughput) (bench/decode/bounds.py)",
    }


@dataclass
class DecodeReport:
    """One run's result file, ``<out>/decode-<gpu>-<yyyymmdd>.json`` (`provenance.gpu_slug`),
    rewritten after every row so that a killed run keeps what it measured; `rows`, `notes` and
    `studies` fill as the run goes."""

    out_dir: Path
    commit: str
    gpu: str
    config: dict[str, Any]
    bandwidth: float  # copy bandwidth of this run, bytes/s
    correctness: dict[str, Any]
    started: float  # time.perf_counter() at the start of the run
    flops_per_s: float | None = None  # bf16 dense GEMM throughput of this run (bounds)
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    studies: dict[str, Any] = field(default_factory=dict)

    def add_row(
        self,
        model_name: str,
        system: str,
        batch: int,
        context: int,
        res: dict[str, Any],
        config: ModelConfig,
    ) -> None:
        """Record one timing `res` (`time_engine` or `time_hf`) as a row, write the file and
        print the row's line. The row: TPOT p50/p99 against the floor at the run's mean context
        and every step's time; our engine's rows also carry the step phases, the host time not
        overlapped with the device and the graph replay alone."""
        floor = floor_ms(config, batch, res["mean_context"], self.bandwidth)
        p50 = statistics.median(res["step_ms"])
        row = {
            "model": model_name,
            "system": system,
            "batch": batch,
            "context": context,
            "tpot_ms_p50": round(p50, 4),
            "tpot_ms_p99": round(sample_percentile(res["step_ms"], 99), 4),
            "floor_ms": round(floor, 4),
            "bandwidth_frac": round(floor / p50, 4),
            "n_steps": len(res["step_ms"]),
            "raw_step_ms": [round(x, 4) for x in res["step_ms"]],
        }
        if self.flops_per_s:
            row["floor_bw_ms"] = row["floor_ms"]
            row |= step_bounds(
                config, batch, res["mean_context"], floor, self.bandwidth, self.flops_per_s
            )
            row["roofline_frac"] = round(row["floor_roofline_ms"] / p50, 4)
        if res.get("phases"):
            # host work not overlapped with the device = step wall time - wait at the sync
            for name, values in res["phases"].items():
                row[f"{name}_ms_p50"] = round(statistics.median(values), 4)
            host = [t - w for t, w in zip(res["step_ms"], res["phases"]["wait"], strict=True)]
            row["host_ms_p50"] = round(statistics.median(host), 4)
        if res.get("graph_ms"):
            row["graph_replay_ms_p50"] = round(statistics.median(res["graph_ms"]), 4)
            row["graph_replay_bandwidth_frac"] = round(floor / row["graph_replay_ms_p50"], 4)
        self.rows.append(row)
        self.write(complete=False)
        print(
            f"{model_name:11s} {system:10s} b={batch:3d} ctx={context:4d} p50={p50:8.3f} "
            f"floor={floor:7.3f} frac={floor / p50:.3f} "
            f"graph={row.get('graph_replay_ms_p50')} host={row.get('host_ms_p50')}",
            flush=True,
        )

    def write(self, complete: bool) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
        """Write the file: (its path, the rows with the floor rows, the speedups)."""
        all_rows = with_floor_rows(self.rows)
        ratios = speedups(all_rows)
        result = {
            "name": "decode",
            "commit": self.commit,
            "gpu": self.gpu,
            "torch": torch.__version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "config": self.config,
            "copy_bandwidth_tb_s": round(self.bandwidth / 1e12, 4),
            "dense_bf16_tflops": round(self.flops_per_s / 1e12, 1) if self.flops_per_s else None,
            "correctness": self.correctness,
            "rows": all_rows,
            "complete": complete,
            "speedups": ratios,
            "targets": targets(all_rows, ratios),
            "studies": self.studies,
            "notes": self.notes,
            "wall_s": round(time.perf_counter() - self.started, 1),
        }
        day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
        out = self.out_dir / f"decode-{gpu_slug(self.gpu)}-{day}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        return out, all_rows, ratios


def print_table(rows: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> None:
    """The table printed last: every row but the floor rows (roofl: the per-kernel roofline
    bound, 0 where not computed), then the speedups over HF."""
    print(
        f"{'model':11s} {'system':10s} {'batch':>5s} {'ctx':>5s} {'p50 ms':>8s} {'p99 ms':>8s} "
        f"{'floor':>7s} {'frac':>6s} {'graph':>7s} {'roofl':>7s}"
    )
    for r in rows:
        if r["system"] == "floor":
            continue
        print(
            f"{r['model']:11s} {r['system']:10s} {r['batch']:5d} {r['context']:5d} "
            f"{r['tpot_ms_p50']:8.3f} {r['tpot_ms_p99']:8.3f} {r['floor_ms']:7.3f} "
            f"{r['bandwidth_frac']:6.3f} {r.get('graph_replay_ms_p50', 0):7.3f} "
            f"{r.get('floor_roofline_ms', 0):7.3f}"
        )
    for s in ratios:
        print(f"speedup {s['model']} {s['ours']} b={s['batch']} vs {s['vs']}: {s['speedup']}x")


def print_targets(goals: dict[str, Any]) -> None:
    """Issue 3's targets (`targets`), one line each."""
    for t in goals["hf_eager_speedup_b64"]:
        print(
            f"target >=10x HF eager b=64: {t['model']} {t['ours']} ctx={t['context']} "
            f"{t['speedup']}x {'met' if t['met'] else 'MISSED'}"
        )
    for t in goals["bandwidth_frac_b_ge_8"]:
        below = ", ".join(
            f"b{b['batch']} {b['frac']} (roofline {b['roofline_over_floor']}x floor)"
            for b in t["below"]
        )
        print(
            f"target >=0.8 floor b>=8: {t['model']} {t['ours']} ctx={t['context']} "
            f"min {t['min_frac']} {'met' if t['met'] else 'MISSED: ' + below}"
        )
