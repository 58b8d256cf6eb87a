"""Results of ``python -m bench.multilora``: the rows beside each mix's `harli` row (mixed prefill
steps, the torch sampler, the previous eager LoRA path), the fields every row of a target set
carries and the overheads against its base row (`finish_rows`), the checks' keys (`check_key`),
the result file's name and contents (`result_path`, `result_document`) and the table printed
last (`print_table`)."""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.provenance import gpu_slug
from bench.common.samples import sample_percentile
from bench.multilora.setup import MODES

GB = 1e9


def check_key(targets: str, mode: str) -> str:
    return targets if mode == MODES[0] else f"{targets}/{mode}"


def mixed_prefill_rows(
    mixed_steps: dict[str, list[float]], batch: int, context: int
) -> list[dict[str, Any]]:
    """One row per system of `time_mixed_steps`: a step of `batch - 1` decode rows beside a new
    `context`-token prefill."""
    return [
        {
            "system": system,
            "targets": "-",
            "mix": "base",
            "adapter_rows": 0,
            "tpot_ms_p50": round(statistics.median(times), 4),
            "tpot_ms_p99": round(sample_percentile(times, 99), 4),
            "graph_replay_ms_p50": None,
            "note": f"one step: {batch - 1} decode rows + a {context}-token prefill "
            "chunk (new request); _old: per-sequence torch attention loop, unfused model",
        }
        for system, times in mixed_steps.items()
    ]


def torch_sampler_row(row: dict[str, Any], torch_sampler_ms: list[float]) -> dict[str, Any]:
    """The base steps of `row` timed again with the torch sampler."""
    return {
        "system": "harli_torch_sampler",
        "targets": "-",
        "mix": row["mix"],
        "adapter_rows": 0,
        "tpot_ms_p50": round(statistics.median(torch_sampler_ms), 4),
        "tpot_ms_p99": round(sample_percentile(torch_sampler_ms, 99), 4),
        "graph_replay_ms_p50": row["graph_replay_ms_p50"],
        "note": "base steps with the multi-kernel torch sampler (before f981f9c)",
    }


def eager_lora_row(row: dict[str, Any], targets: str, eager_ms: list[float]) -> dict[str, Any]:
    """The previous LoRA path (eager `runtime.forward`) over the same rows as `row`."""
    return {
        "system": "harli_eager_lora",
        "targets": targets,
        "mix": row["mix"],
        "adapter_rows": row["adapter_rows"],
        "graph_replay_ms_p50": None,
        "forward_ms_p50": round(statistics.median(eager_ms), 4),
        "note": "previous path: eager runtime.forward over the same buffers, "
        "forward only (no sampling/host work)",
    }


def finish_rows(rows: list[dict[str, Any]], fields: dict[str, Any], slot_bytes: int) -> None:
    """Adds `fields` (the target set's configuration) and `slot_mem_gb` to every row, and to each
    `harli` row its step's (and graph replay's) overhead against the first row, the base mix."""
    base = rows[0]
    for row in rows:
        row.update(fields | {"slot_mem_gb": round(slot_bytes / GB, 4)})
        if row["system"] == "harli":
            row["overhead_frac"] = round(row["tpot_ms_p50"] / base["tpot_ms_p50"] - 1, 4)
            if row["graph_replay_ms_p50"] and base["graph_replay_ms_p50"]:
                ratio = row["graph_replay_ms_p50"] / base["graph_replay_ms_p50"]
                row["graph_overhead_frac"] = round(ratio - 1, 4)


def result_path(out_dir: str, gpu: str) -> Path:
    """``<out_dir>/multilora-<gpu>-<yyyymmdd>.json`` (UTC day; `provenance.gpu_slug`, as every
    bench names its file), its folder created."""
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    out = Path(out_dir) / f"multilora-{gpu_slug(gpu)}-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def result_document(
    args: argparse.Namespace,
    *,
    gpu: str,
    dtype: str,
    checks: dict[str, Any],
    rows: list[dict[str, Any]],
    started: float,
) -> dict[str, Any]:
    """The result file's contents so far (`started`: the run's `time.perf_counter()` start)."""
    return {
        "name": "multilora",
        "commit": args.commit,
        "gpu": gpu,
        "torch": torch.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "config": vars(args) | {"dtype": dtype, "block_size": 16, "sampling": "t=0.8"},
        "checks": checks,
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def print_table(rows: list[dict[str, Any]], checks: dict[str, Any]) -> None:
    """Every row's step p50, graph (or eager forward) ms and overheads, then every check; the
    text columns are as wide as their longest value, so the numbers stay under their headers."""
    names = ("system", "targets", "mode", "mix")
    widths = [max([len(name), *(len(str(r[name])) for r in rows)]) for name in names]
    head = " ".join(f"{name:{w}s}" for name, w in zip(names, widths, strict=True))
    print(f"{head} {'p50 ms':>8s} {'graph ms':>9s} {'overhead':>9s} {'graph ovh':>9s}")
    for r in rows:
        graph = r.get("graph_replay_ms_p50") or r.get("forward_ms_p50") or 0.0
        text = " ".join(f"{str(r[name]):{w}s}" for name, w in zip(names, widths, strict=True))
        print(
            f"{text} {r.get('tpot_ms_p50', 0):8.3f} {graph:9.3f} {r.get('overhead_frac', 0):+9.3f} "
            f"{r.get('graph_overhead_frac') or 0:+9.3f}"
        )
    for name, check in checks.items():
        print(f"check {name}: {check}")
