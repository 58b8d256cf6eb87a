"""Penalties and logit bias in the sampler: `Engine.step()` TPOT of steady decode batches (batch
8 and 64, context 512) with plain sampling (temperature 0.8: the fused one-pass kernel) and with
every row asking presence, frequency and repetition penalties and a logit bias of 10 entries.

A Llama-3-8B-shaped model (seeded random bf16 weights) and an engine over random KV storage,
CUDA graphs captured per batch; sequences are injected with `context - 1` tokens treated as
cached, so every step is a decode step, and TPOT is the wall time of `Engine.step()`
(scheduling, staging, graph replay, the processors and sampling, the host sync). The two mixes
run alternately `--repeats` times per batch and scheduling mode (`--scheduling`: synchronous
steps and async scheduling, the server's default) in one process (plain, penalties, plain, ...); the
ratio row divides the penalised median by the plain one, and `aa_spread` is the largest
relative difference between the plain repeats' medians (the run's noise). Before timing, the
forced-token check (greedy rows with +100 on one token sample only it, through the graphs) and
the processed logits against a float64 reference must pass.

Run: `python -m bench.sampling --out DIR` (about a minute on an H200); `--tiny` is a CPU smoke
run (tiny model, batch 2, context 16, a few steps; no result is committed from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import torch

from bench.common.provenance import commit_hash, write_result
from bench.sampling.measure import (
    build_engine,
    check_forced_token,
    check_processed_logits,
    mixes,
    summary,
    time_steps,
)
from gpu_runtime.model import ModelConfig, build_random_model
from gpu_runtime.model.tiny import tiny_config

TPOT_RATIO_TARGET = 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny model")
    parser.add_argument("--model", default="llama3-8b", help="preset (ignored with --tiny)")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mix per batch")
    parser.add_argument("--scheduling", default="sync,async", help="subset of sync,async")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.model, args.batches, args.context = "tiny", "2", 16
        args.steps, args.warmup, args.repeats = 4, 1, 2
    args.batch_list = [int(b) for b in args.batches.split(",") if b]
    args.modes = [m for m in args.scheduling.split(",") if m]
    if not args.batch_list or args.repeats < 1 or args.steps < 1:
        parser.error(f"batches={args.batches!r}, repeats={args.repeats}, steps={args.steps}")
    if not args.modes or not set(args.modes) <= {"sync", "async"}:
        parser.error(f"scheduling={args.scheduling!r} must be a subset of sync,async")
    return args


def measure_batch(engine: Any, args: argparse.Namespace, batch: int) -> list[dict[str, Any]]:
    """The rows of one batch: per mix its pooled steps' median and p99, then the ratio row."""
    params = mixes(engine.model_config.vocab_size)
    times: dict[str, list[list[float]]] = {name: [] for name in params}
    for repeat in range(args.repeats):
        for name, p in params.items():
            seed = batch * 1000 + repeat
            times[name].append(
                time_steps(engine, batch, args.context, p, args.warmup, args.steps, seed)
            )
    base = {
        "model": args.model,
        "system": "harli",
        "scheduling": "async" if engine.config.async_scheduling else "sync",
        "batch": batch,
        "context": args.context,
    }
    rows = []
    for name, runs in times.items():
        pooled = [t for run in runs for t in run]
        rows.append(base | {"sampling": name, "steps": len(pooled)} | summary(pooled))
    plain_runs = [summary(run)["tpot_ms_p50"] for run in times["plain"]]
    spread = (max(plain_runs) - min(plain_runs)) / min(plain_runs)
    ratio = rows[1]["tpot_ms_p50"] / rows[0]["tpot_ms_p50"]
    rows.append(
        base
        | {
            "sampling": "penalties/plain",
            "tpot_ratio_p50": ratio,
            "tpot_ratio_p99": rows[1]["tpot_ms_p99"] / rows[0]["tpot_ms_p99"],
            "aa_spread": spread,
            "target": TPOT_RATIO_TARGET,
            "meets_target": ratio <= TPOT_RATIO_TARGET,
        }
    )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"sched {'batch':>5} {'ctx':>5} {'sampling':<16} {'p50 ms':>8} {'p99 ms':>8} ratio")
    for r in rows:
        head = f"{r['scheduling']:<5} {r['batch']:>5} {r['context']:>5} {r['sampling']:<16}"
        if "tpot_ratio_p50" in r:
            print(f"{head} {'':>8} {'':>8} {r['tpot_ratio_p50']:>7.3f}  (A/A {r['aa_spread']:.3f})")
        else:
            print(f"{head} {r['tpot_ms_p50']:>8.3f} {r['tpot_ms_p99']:>8.3f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        config, dtype = tiny_config("llama"), "float32"
    else:
        config, dtype = ModelConfig.preset(args.model), "bfloat16"
    model = build_random_model(config, seed=0, device=device, dtype=dtype)
    total_steps = args.warmup + args.steps + 8
    engine = build_engine(model, device, args.batch_list, args.context, total_steps)
    checks = check_forced_token(engine, max(args.batch_list), args.context)
    checks |= check_processed_logits(engine, max(args.batch_list))
    if not (checks["forced_token_ok"] and checks["processed_logits_ok"]):
        raise SystemExit(f"checks failed before timing: {checks}")
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        engine.config = dataclasses.replace(engine.config, async_scheduling=mode == "async")
        for batch in args.batch_list:
            rows += measure_batch(engine, args, batch)
    checks["fused_samples"] = engine.runner.sampler.num_fused_samples
    checks["processed_samples"] = engine.runner.sampler.num_processed_samples
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    config_record = {
        "model": args.model,
        "dtype": dtype,
        "batches": args.batch_list,
        "context": args.context,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "mixes": {name: repr(p) for name, p in mixes(model.config.vocab_size).items()},
        "cuda_graphs": device.type == "cuda",
        "scheduling": args.modes,
    }
    path = write_result(
        "sampling",
        args.out,
        gpu,
        torch.__version__,
        commit_hash(),
        config=config_record,
        checks=checks,
        rows=rows,
        wall_s=time.perf_counter() - started,
    )
    print(f"\nwrote {path} in {time.perf_counter() - started:.1f} s")
    print_table(rows)
