"""Decode-latency predictor: held-out accuracy (stage 1 and 2) beside the roofline, µs per call.

Run: ``python bench/predictor.py [--data CSV] [--quick]`` (CPU only: training in torch, inference
through onnxruntime on this host's CPU, one intra-op thread). It trains on the profiled data
(measured on the GPU by ``predictor_models.profile``), holds out whole configuration buckets,
writes a new versioned artifact under ``predictor_models/artifacts/``, scores the held-out rows
through the exported ONNX graph, times single and batch-of-64 calls, and writes
``bench/results/predictor-<gpu>-<yyyymmdd>.json`` (``gpu`` = the GPU the data was measured on).

The timing also reports a trivial ONNX graph's call time in the same process (``ort_floor_us``):
on a shared, loaded host the floor itself moves, and the ratio to it holds better than absolutes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_runtime.predictor.runtime import LatencyPredictor
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum
from predictor_models.pipeline import (
    DEFAULT_DATA,
    DEFAULT_ROOT,
    evaluate_artifact,
    fit_and_export,
)

TARGETS = {"stage1_mape": 0.03, "stage2_mape": 0.05, "p95_ape": 0.10, "batch64_us": 50.0}


def per_call_us(fn: Callable[[], object], calls: int = 200, blocks: int = 15) -> float:
    """Median over blocks of the mean µs per call (after a warm-up block)."""
    for _ in range(calls):
        fn()
    means = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(means)


def ort_floor_us() -> float:
    """µs per call of a one-node ONNX graph of the same input: the session-call floor here."""
    import onnxruntime as ort

    class Sum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(-1)

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "floor.onnx"
        torch.onnx.export(
            Sum(),
            (torch.ones(2, 11),),
            str(path),
            dynamo=False,
            input_names=["features"],
            dynamic_axes={"features": {0: "n"}},
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rows = np.ones((64, 11), dtype=np.float32)
    return per_call_us(lambda: session.run(None, {"features": rows}))


def timing(predictor: LatencyPredictor) -> dict[str, float]:
    """µs per call: one stage-2 row, a batch of 64 rows, and ``score`` over 64 candidates."""
    iteration = DecodeIteration.from_contexts([900] * 48, 0, decode_sm_share=64 / 132)
    quanta = [
        FinetuneQuantum(t, s, r, b, 1 - d / 132)
        for d in (32, 48, 64, 80)
        for t, s in ((512, 512), (1024, 512), (2048, 1024), (4096, 1024))
        for r in (16,)
        for b in (False, True)
    ]
    quanta = (quanta * 2)[:64]
    shares = [1 - q.sm_share for q in quanta]
    rows = np.array([iteration.row() + q.row() for q in quanta], dtype=np.float32)
    for i, share in enumerate(shares):
        rows[i, 5] = share
    candidates = list(zip(shares, quanta, strict=True))
    return {
        "single_us": per_call_us(lambda: predictor.stage2(iteration, quanta[0])),
        "batch64_us": per_call_us(lambda: predictor.predict(rows)),
        "score64_us": per_call_us(lambda: predictor.score(iteration, candidates)),
        "ort_floor_us": ort_floor_us(),
    }


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="artifact root")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true", help="one candidate per stage")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    artifact, result = fit_and_export(args.data, args.root, args.quick)
    train_s = time.perf_counter() - started
    predictor = LatencyPredictor.load(artifact)
    onnx_metrics = evaluate_artifact(artifact, args.data)
    times = timing(predictor)
    meta = predictor.metadata.raw
    rows: list[dict[str, Any]] = []
    for stage in (1, 2):
        key = f"stage{stage}"
        for who in ("harli", "roofline"):
            m = onnx_metrics[key] if who == "harli" else result.metrics[key]["roofline"]
            rows.append(
                {
                    "model": meta["model"],
                    "stage": stage,
                    "predictor": who,
                    "mape": m["mape"],
                    "p95_ape": m["p95_ape"],
                    "n_test": m["n"],
                    "infer_us_single": times["single_us"] if who == "harli" else None,
                    "infer_us_batch64": times["batch64_us"] if who == "harli" else None,
                }
            )
    by = {(r["stage"], r["predictor"]): r for r in rows}
    comparisons = {
        "stage1_mape_vs_roofline": by[1, "harli"]["mape"] / by[1, "roofline"]["mape"],
        "stage2_mape_vs_roofline": by[2, "harli"]["mape"] / by[2, "roofline"]["mape"],
        "batch64_us_over_ort_floor": times["batch64_us"] / times["ort_floor_us"],
        "meets": {
            "stage1_mape": by[1, "harli"]["mape"] <= TARGETS["stage1_mape"],
            "stage2_mape": by[2, "harli"]["mape"] <= TARGETS["stage2_mape"],
            "p95_ape": max(by[1, "harli"]["p95_ape"], by[2, "harli"]["p95_ape"])
            <= TARGETS["p95_ape"],
            "batch64_us": times["batch64_us"] <= TARGETS["batch64_us"],
        },
    }
    import onnxruntime

    out = {
        "name": "predictor",
        "commit": _commit(),
        "gpu": meta["gpu"],
        "torch": torch.__version__,
        "created": dt.datetime.now(dt.UTC).isoformat(),
        "config": {
            "data": meta["data"],
            "artifact": str(Path(artifact).relative_to(Path.cwd()))
            if Path(artifact).is_relative_to(Path.cwd())
            else str(artifact),
            "artifact_version": meta["version"],
            "chosen": result.chosen,
            "cv_mape": result.cv,
            "n_train": result.n_train,
            "train_config": result.config,
            "train_s": train_s,
            "held_out": onnx_metrics["scope"],
            "onnxruntime": onnxruntime.__version__,
            "intra_op_threads": 1,
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "timing": times,
            "targets": TARGETS,
        },
        "rows": rows,
        "comparisons": comparisons,
    }
    gpu_key = meta["gpu_key"]
    path = Path(args.out) / f"predictor-{gpu_key}-{dt.datetime.now(dt.UTC):%Y%m%d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"artifact {artifact}; chosen {result.chosen}; trained in {train_s:.0f} s")
    print(
        f"timing (µs): {json.dumps({k: round(v, 1) for k, v in times.items()})}; "
        f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'stage':>5} {'predictor':10} {'MAPE':>7} {'p95 APE':>8} {'n':>4} {'µs 1':>7} "
        f"{'µs 64':>7}"
    )
    for r in rows:
        single = f"{r['infer_us_single']:.1f}" if r["infer_us_single"] else "-"
        batch = f"{r['infer_us_batch64']:.1f}" if r["infer_us_batch64"] else "-"
        print(
            f"{r['stage']:>5} {r['predictor']:10} {100 * r['mape']:6.2f}% "
            f"{100 * r['p95_ape']:7.2f}% {r['n_test']:>4} {single:>7} {batch:>7}"
        )
    print(f"meets targets: {comparisons['meets']}; wrote {path}")


if __name__ == "__main__":
    main()
