"""The record of a ``bench/finetune/run.py`` run: the summaries over its training rows (ours vs
HF + PEFT, graphed vs eager at the same shape), the result JSON (rewritten after every row, so a
one-shot GPU run that dies keeps what it measured) and the tables printed last."""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.finetune.runs import GB
from gpu_runtime.model import ModelConfig


def _times(ratio: float | None) -> str:
    """A memory ratio as printed: ``n/a`` where the reference measured none (no peak counter
    on the CPU)."""
    return "n/a" if ratio is None else f"{ratio}x"


def mem_ratio(row: dict[str, Any], ref: dict[str, Any], key: str) -> float | None:
    return round(row[key] / ref[key], 3) if ref[key] else None


def summaries(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(ratios, graph_gains): every ok `harli` row against the ok `hf_peft` and `harli_eager`
    rows of the same targets, seq and micro-batch."""
    ratios, graph_gains = [], []
    for row in rows:
        if row["system"] != "harli" or row["status"] != "ok":
            continue
        for ref in rows:
            same = all(ref[k] == row[k] for k in ("targets", "seq_len", "micro_batch"))
            if same and ref["system"] == "harli_eager" and ref["status"] == "ok":
                graph_gains.append(
                    {
                        "targets": row["targets"],
                        "seq_len": row["seq_len"],
                        "micro_batch": row["micro_batch"],
                        "step_ms_graphed": row["step_ms_p50"],
                        "step_ms_eager": ref["step_ms_p50"],
                        "launch_ms_graphed": row.get("launch_ms_p50"),
                        "launch_ms_eager": ref.get("launch_ms_p50"),
                        "host_ms_graphed": row.get("host_ms_p50"),
                        "host_ms_eager": ref.get("host_ms_p50"),
                        "speedup": round(row["tokens_per_s"] / ref["tokens_per_s"], 3),
                    }
                )
            if same and ref["system"] == "hf_peft" and ref["status"] == "ok":
                ratios.append(
                    {
                        "targets": row["targets"],
                        "seq_len": row["seq_len"],
                        "micro_batch": row["micro_batch"],
                        "speedup": round(row["tokens_per_s"] / ref["tokens_per_s"], 3),
                        "peak_mem_ratio": mem_ratio(row, ref, "peak_mem_gb"),
                        "extra_mem_ratio": mem_ratio(row, ref, "extra_mem_on_decode_gpu_gb"),
                    }
                )
    return ratios, graph_gains


def write_result(
    out: Path,
    args: argparse.Namespace,
    config: ModelConfig,
    gpu: str,
    base_bytes: int,
    rows: list[dict[str, Any]],
    decode_rows: list[dict[str, Any]],
    started: float,
) -> dict[str, Any]:
    """Write the run's JSON to `out` (the rows so far, their summaries, the options); return it."""
    ratios, graph_gains = summaries(rows)
    result = {
        "name": "finetune",
        "commit": args.commit,
        "gpu": gpu,
        "torch": torch.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "config": {
            **vars(args),
            "model_config": config.to_hf_config(),
            "lora": f"rank {args.rank}, alpha {2 * args.rank}, dropout 0.05; AdamW fused, lr 2e-4, "
            "clip 1.0",
            "base_weights_gb": base_bytes / GB,
        },
        "rows": rows,
        "multi_lora_decode": decode_rows,
        "ratios": ratios,
        "graph_gains": graph_gains,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def print_tables(
    out: Path,
    result: dict[str, Any],
    rows: list[dict[str, Any]],
    decode_rows: list[dict[str, Any]],
) -> None:
    """The training rows, the summaries and the decode rows, one line each."""
    print(f"\nwrote {out} in {result['wall_s']} s")
    print(
        f"{'targets':7s} {'seq':>5s} {'mb':>3s} {'system':16s} {'tok/s':>9s} {'step ms':>8s} "
        f"{'peak GB':>8s} {'extra GB':>8s} {'loss0':>7s}"
    )
    for r in rows:
        if r["status"] != "ok":
            print(
                f"{r['targets']:7s} {r['seq_len']:5d} {r['micro_batch']:3d} {r['system']:16s} "
                f"{r['status']}"
            )
            continue
        print(
            f"{r['targets']:7s} {r['seq_len']:5d} {r['micro_batch']:3d} {r['system']:16s} "
            f"{r['tokens_per_s']:9.0f} {r['step_ms_p50']:8.1f} {r['peak_mem_gb']:8.2f} "
            f"{r['extra_mem_on_decode_gpu_gb']:8.2f} {r['first_loss']:7.3f}"
        )
    for ratio in result["ratios"]:
        print(
            f"speedup {ratio['targets']} seq {ratio['seq_len']} mb {ratio['micro_batch']}: "
            f"{ratio['speedup']:.2f}x tokens/s, peak mem {_times(ratio['peak_mem_ratio'])}, "
            f"extra mem on a decode GPU {_times(ratio['extra_mem_ratio'])}"
        )
    for gain in result["graph_gains"]:
        print(
            f"CUDA graphs {gain['targets']} seq {gain['seq_len']} mb {gain['micro_batch']}: "
            f"step {gain['step_ms_eager']} -> {gain['step_ms_graphed']} ms "
            f"({gain['speedup']:.2f}x), host {gain['host_ms_eager']} -> "
            f"{gain['host_ms_graphed']} ms (launch {gain['launch_ms_eager']} -> "
            f"{gain['launch_ms_graphed']} ms)"
        )
    for d in decode_rows:
        if "forward_ms_p50" in d:  # the eager LoRA forward: no step, no graph
            print(
                f"decode batch {d['batch']} {d['system']:16s} adapters {d['adapters']} "
                f"{d['targets']:4s} forward {d['forward_ms_p50']:.3f} ms (eager)"
            )
            continue
        if "step_ms_p50" not in d:
            print(f"decode {d['system']}: {d.get('status', 'no timing')}")
            continue
        print(
            f"decode batch {d['batch']} {d['system']:16s} adapters {d['adapters']} "
            f"{d['targets']:4s} {d['step_ms_p50']:.3f} ms (+{100 * d['overhead_frac']:.1f}%) "
            f"graph={d['cuda_graph']}"
        )
