"""Steps that carry prefill chunks: where their time goes, varlen attention against SDPA.

Llama-3-8B (random bf16 weights, random KV) in the co-location deployment's engine shape
(block 16, max_num_seqs 64, max_num_batched_tokens 512, mixed-step graphs for token buckets
64/128/256/512). Each case is one step built straight into the runner (decode rows at various
contexts, chunks from scratch or after a cached prefix); the step's model work (staging, the
mixed-step graphs, the eager attention per layer, logits of the sampled rows) runs repeatedly
through `GeneralPath.mixed_graph_logits` (re-running a step rewrites the same K/V), with
`chunk_attention` "sdpa" (the previous path) and "varlen" (one Triton launch per layer):

1. correctness: logits of both modes agree (relative norm error, argmax agreement);
2. timing per case and mode: host time until the call returns (launches queued), wall time to
   the end of the device's work, device time between two events;
3. torch.profiler of one case per mode: CPU total vs CUDA total, top ops by device time.

Sampling, scheduling and output handling are not included (a few hundred us per step).
Run: `python -m bench.decode.chunks --out DIR`; writes
`decode-chunks-<gpu>-<yyyymmdd>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.engine.scheduler import NewRequestData, SchedulerOutput
from gpu_runtime.model import ModelConfig, build_random_model

# (name, decode contexts, chunks as (cached prefix, chunk tokens, samples: chunk ends prompt))
CASES: list[tuple[str, list[int], list[tuple[int, int, bool]]]] = [
    ("16 rows + 1x64", [300 + 37 * i for i in range(16)], [(0, 64, True)]),
    ("16 rows + 1x496", [300 + 37 * i for i in range(16)], [(0, 496, True)]),
    (
        "20 rows + 3 chunks (200, 180 after 300, 110)",
        [250 + 41 * i for i in range(20)],
        [(0, 200, True), (300, 180, True), (0, 110, False)],
    ),
    (
        "62 rows + 2 chunks (256, 192 after 320)",
        [200 + 23 * i for i in range(62)],
        [(0, 256, False), (320, 192, True)],
    ),
    ("1 row + 1x511", [700], [(0, 511, True)]),
    ("3 rows + 2x32 (one after 1500)", [400, 800, 1200], [(0, 32, True), (1500, 32, True)]),
]
PROFILED = 2  # the 3-chunk case


def build_engine(num_blocks: int) -> Engine:
    config = ModelConfig.preset("llama3-8b")
    model = build_random_model(config, seed=0, device=torch.device("cuda"), dtype="bfloat16")
    engine = Engine(
        model,
        EngineConfig(
            num_kv_blocks=num_blocks,
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            max_model_len=2048,
            device="cuda",
            mixed_cuda_graphs=True,
            cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64),
        ),
        kv_storage_factory=lambda shape, dtype, device: torch.empty(
            shape, dtype=dtype, device=device
        ).normal_(),
    )
    engine.capture_cuda_graphs(batch_sizes=(1,))  # decode bucket 1 + every mixed token bucket
    return engine


def install_step(
    engine: Engine, case: int, decode: list[int], chunks: list[tuple[int, int, bool]]
) -> list[tuple[str, int]]:
    """Put the case's requests into the runner's state; returns the step's order."""
    runner = engine.runner
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(case)
    free = rng.permutation(engine.config.num_kv_blocks).tolist()
    params = SamplingParams(max_tokens=64, ignore_eos=True, detokenize=False)
    new, scheduled = [], {}
    rows = [(ctx - 1, 1, True) for ctx in decode] + chunks
    for i, (prefix, count, samples) in enumerate(rows):
        total = prefix + count + (0 if samples else 64)
        blocks = [free.pop() for _ in range(-(-total // 16))]
        rid = f"case{case}-{i}"
        tokens = rng.integers(0, vocab, total).tolist()
        new.append(NewRequestData(rid, tokens, blocks, prefix, params, 0))
        scheduled[rid] = count
    runner.rows.sync(SchedulerOutput(new, [], scheduled))
    return list(scheduled.items())


def drop_step(engine: Engine, order: list[tuple[str, int]]) -> None:
    engine.runner.rows.sync(SchedulerOutput([], [], {}, {rid for rid, _ in order}))


def set_mode(engine: Engine, mode: str) -> None:
    engine.runner.config = dataclasses.replace(engine.runner.config, chunk_attention=mode)


def run_step(engine: Engine, order: list[tuple[str, int]]) -> torch.Tensor:
    result = engine.runner.general.mixed_graph_logits(order, engine.runner.states, None)
    if result is None:
        raise RuntimeError("step not replayable from the mixed-step graphs")
    return result[0]


@torch.no_grad()
def time_step(engine: Engine, order: list[tuple[str, int]], reps: int) -> dict[str, float]:
    for _ in range(2):
        run_step(engine, order)
    torch.cuda.synchronize()
    host, wall, device = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        t0 = time.perf_counter()
        start.record()
        run_step(engine, order)
        end.record()
        t1 = time.perf_counter()
        end.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        device.append(start.elapsed_time(end))
    return {
        "host_ms": round(statistics.median(host), 3),
        "wall_ms": round(statistics.median(wall), 3),
        "wall_ms_max": round(max(wall), 3),
        "device_ms": round(statistics.median(device), 3),
    }


@torch.no_grad()
def profile_step(engine: Engine, order: list[tuple[str, int]], reps: int = 3) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    run_step(engine, order)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run_step(engine, order)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / reps
    events = prof.key_averages()
    cpu_total = sum(e.self_cpu_time_total for e in events) / 1e3 / reps
    device_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 / reps
    top = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)

    def row(e: Any) -> dict[str, Any]:
        return {
            "name": e.key[:90],
            "calls_per_step": round(e.count / reps, 1),
            "device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3 / reps, 3),
            "cpu_ms": round(e.self_cpu_time_total / 1e3 / reps, 3),
        }

    try:
        table = events.table(
            sort_by="self_device_time_total", row_limit=15, max_name_column_width=60
        )
    except (KeyError, AttributeError, ValueError):
        table = events.table(sort_by="self_cuda_time_total", row_limit=15)
    return {
        "wall_ms_per_step": round(wall, 3),
        "cpu_self_ms_per_step": round(cpu_total, 3),
        "device_self_ms_per_step": round(device_total, 3),
        "top_device": [row(e) for e in top[:15]],
        "top_cpu": [row(e) for e in top_cpu[:10]],
        "table": table,
    }


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--modes", default="sdpa,varlen")
    args = parser.parse_args()
    modes = args.modes.split(",")
    engine = build_engine(num_blocks=8192)
    results: dict[str, Any] = {
        "name": "decode-chunks",
        "commit": args.commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "config": {
            "model": "llama3-8b bf16 random",
            "engine": "block 16, max_num_seqs 64, max_num_batched_tokens 512, mixed graphs "
            "64/128/256/512, decode buckets 1..64",
            "timed": "GeneralPath.mixed_graph_logits per step (no sampling/scheduling), "
            f"median of {args.reps} after 2 warm-up",
        },
        "cases": [],
        "profiles": {},
    }
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    out = Path(args.out) / f"decode-chunks-h200-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mixed = engine.runner.general.mixed_graphs
    for index, (name, decode, chunks) in enumerate(CASES):
        order = install_step(engine, index, decode, chunks)
        tokens = sum(n for _, n in order)
        row: dict[str, Any] = {
            "case": name,
            "decode_rows": len(decode),
            "chunks": [list(c) for c in chunks],
            "tokens": tokens,
            "bucket": mixed.bucket_for(tokens) if mixed else None,
        }
        logits = {}
        for mode in modes:
            set_mode(engine, mode)
            logits[mode] = run_step(engine, order).float().clone()
        if len(modes) == 2:
            a, b = logits[modes[0]], logits[modes[1]]
            row["logits_rel_err"] = round(float((a - b).norm() / a.norm()), 5)
            row["argmax_agree"] = round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4)
            row["finite"] = bool(torch.isfinite(b).all())
        for mode in modes:
            set_mode(engine, mode)
            row[mode] = time_step(engine, order, args.reps)
        print("case", json.dumps(row), flush=True)
        if index == PROFILED:
            for mode in modes:
                set_mode(engine, mode)
                prof = profile_step(engine, order)
                print(
                    f"--- profile {name} [{mode}]: wall {prof['wall_ms_per_step']} ms/step, "
                    f"CPU self {prof['cpu_self_ms_per_step']} ms, device self "
                    f"{prof['device_self_ms_per_step']} ms"
                )
                print(prof.pop("table"), flush=True)
                results["profiles"][mode] = prof
        results["cases"].append(row)
        drop_step(engine, order)
        out.write_text(json.dumps(results, indent=1))
    set_mode(engine, "varlen")
    print(f"wrote {out}")
    header = f"{'case':46s} {'tok':>4s} {'bkt':>4s} {'err':>8s}"
    for mode in modes:
        header += f" | {mode + ' host/wall/dev ms':>26s}"
    print(header)
    for row in results["cases"]:
        line = f"{row['case']:46s} {row['tokens']:4d} {row['bucket']:4d} "
        line += f"{row.get('logits_rel_err', 0):8.5f}"
        for mode in modes:
            t = row[mode]
            line += f" | {t['host_ms']:8.2f} {t['wall_ms']:8.2f} {t['device_ms']:8.2f}"
        print(line)


if __name__ == "__main__":
    main()
