"""Decode speed on one GPU: our engine vs HF transformers (eager; static cache + torch.compile)
vs the HBM floor, for Llama-3-8B and Qwen2.5-7B shapes with random bf16 weights.

Per model: build seeded random weights; our engine with CUDA graphs captured per batch bucket;
for each (batch, context) inject `batch` sequences whose first `context - 1` tokens already sit
in the KV cache (filled with random values, never zeros), then time `Engine.step()` end to end
(scheduler, input preparation, graph replay, sampling, the one host sync) over many decode
steps; also the graph replay alone with CUDA events. HF runs on the same weight tensors. The
floor is (weight bytes read once + the batch's KV bytes) / device-to-device copy bandwidth
measured in the same run; beside it, per row, the compute floor and the per-kernel roofline from
a bf16 GEMM timed in the same run (``bounds``). The engine runs as
`python -m gpu_runtime.server` deploys it (async scheduling, system ``harli``) and
synchronously (``harli_sync``, the engine default and the co-location loop's mode); the JSON's
``targets`` hold issue 3's two targets against each.

Run: `python -m bench.decode` (see --help; --quick for a smoke run).

This module runs the benchmark; beside it: ``args`` (the command line), ``engine``
(our engine: build, inject, time, variants, prefill chunks), ``hf`` (the HF references
and the correctness check), ``bounds`` (compute floor, roofline), ``report``
(rows, floor, speedups, targets, result file, the table),
``extras`` (the ``--extras`` studies) and ``profile`` (``--profile``).
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.decode.args import Sweep, apply_quick, parse_args
from bench.decode.bounds import dense_throughput
from bench.decode.engine import (
    DEVICE,
    PREFILL_PROMPT,
    bucket_for,
    build_engine,
    copy_bandwidth,
    recover,
    set_variant,
    time_engine,
    time_prefill_chunks,
)
from bench.decode.extras import gemm_backends, mixed_step_profile, sampler_paths
from bench.decode.hf import check_correctness, hf_model, time_hf
from bench.decode.profile import run_profile
from bench.decode.report import (
    DecodeReport,
    print_table,
    print_targets,
    run_config,
    targets,
)
from gpu_runtime.engine import Engine
from gpu_runtime.model import CausalLM, ModelConfig, build_random_model


@dataclass
class DecodeRun:
    """One run's sweep over the models, writing into `report` as it goes."""

    args: argparse.Namespace
    sweep: Sweep
    report: DecodeReport

    def time_model(self, name: str) -> None:
        """One preset: the GEMM study (first model), our engine, then HF on the same weights."""
        config = ModelConfig.preset(name)
        model = build_random_model(config, seed=0, device=DEVICE, dtype="bfloat16")
        sweep, report = self.sweep, self.report
        if "gemm" in sweep.extras and name == sweep.models[0]:
            report.studies["gemm_backends"] = gemm_backends(model, report.bandwidth, sweep.batches)
            report.write(complete=False)
        self.time_ours(name, model, config)
        gc.collect()  # the engine's graphs refer back to its runner: free its KV cache now
        torch.cuda.empty_cache()
        self.time_hf_systems(name, model, config)
        del model
        torch.cuda.empty_cache()

    def time_ours(self, name: str, model: CausalLM, config: ModelConfig) -> None:
        """Our engine on one model: the variants over every batch (sync and async on the same
        graphs, pdl-all / no-pdl on re-captured ones) and the chunk studies (first model)."""
        sweep, report = self.sweep, self.report
        first = name == sweep.models[0]
        engine = build_engine(model, self.args, sweep)
        t0 = time.perf_counter()
        buckets = sorted({bucket_for(engine, x) for x in sweep.batches})
        engine.capture_cuda_graphs(batch_sizes=tuple(buckets))
        print(f"{name}: captured {buckets} in {time.perf_counter() - t0:.1f}s", flush=True)
        for variant in sweep.variants:  # all batches (pdl-all / no-pdl re-capture their graphs)
            set_variant(engine, variant, buckets)
            try:
                self.time_variant(name, config, engine, variant, sweep.batches)
            except Exception as exc:  # keep the other variants' rows; say what broke
                report.notes.append(f"{name} {variant} failed: {type(exc).__name__}: {exc}"[:600])
                traceback.print_exc()
                recover(engine)
        # the chunk studies run synchronously, as the co-location loop runs the engine
        set_variant(engine, "sync", buckets)
        if "mixed" in sweep.extras and first:
            report.studies["mixed_step_profile"] = mixed_step_profile(engine)
            report.write(complete=False)
        if sweep.chunks and first:
            report.studies["prefill_chunks"] = time_prefill_chunks(
                engine, sweep.chunks, 32, min(sweep.contexts), PREFILL_PROMPT
            )
            report.write(complete=False)

    def time_variant(
        self, name: str, config: ModelConfig, engine: Engine, variant: str, batches: list[int]
    ) -> None:
        """Every (context, batch) of `batches` on the engine as `set_variant` left it; the rows
        are system ``harli`` when `variant` is the run's first, else ``harli_<variant>``."""
        args = self.args
        system = "harli" if variant == self.sweep.variants[0] else f"harli_{variant}"
        for context in self.sweep.contexts:
            for batch in batches:
                res = time_engine(engine, batch, context, args.warmup, args.steps)
                self.report.add_row(name, system, batch, context, res, config)

    def time_hf_systems(self, name: str, model: CausalLM, config: ModelConfig) -> None:
        """HF eager at its batches (one out of memory is a note), then HF compile (models in
        --hf-compile-models) while the run's time budget lasts; a compile that fails is a
        note, not a row missing silently."""
        args, report = self.args, self.report
        hf = hf_model(model)
        for batch in self.sweep.hf_eager:
            try:  # a batch that does not fit is a note; the smaller ones and compile go on
                res = time_hf(model, hf, batch, args.hf_context, args.hf_steps, compiled=False)
                report.add_row(name, "hf_eager", batch, args.hf_context, res, config)
            except torch.OutOfMemoryError as exc:
                report.notes.append(f"hf_eager {name} batch {batch} failed: {exc}"[:400])
            torch.cuda.empty_cache()
        if name not in args.hf_compile_models.split(","):
            return
        for batch in self.sweep.hf_compile:
            if time.perf_counter() - report.started > args.budget_s:
                report.notes.append(f"hf_compile {name} batch {batch} skipped: time budget")
                continue
            try:
                res = time_hf(model, hf, batch, args.hf_context, args.hf_steps, compiled=True)
                report.add_row(name, "hf_compile", batch, args.hf_context, res, config)
            except Exception as exc:  # report, do not hide: the row is missing for a reason
                report.notes.append(
                    f"hf_compile {name} batch {batch} failed: {type(exc).__name__}: {exc}"[:400]
                )
            torch._dynamo.reset()
            torch.cuda.empty_cache()


def main() -> None:
    args = parse_args()
    if args.profile:
        run_profile(args)
        return
    if args.quick:
        apply_quick(args)
    started = time.perf_counter()
    sweep = Sweep.from_args(args)
    torch.backends.cuda.matmul.allow_tf32 = True

    bandwidth = copy_bandwidth()
    flops_per_s = dense_throughput(DEVICE)
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 GEMM {flops_per_s / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    correctness = {} if args.skip_check else check_correctness()
    print("correctness", correctness, flush=True)
    report = DecodeReport(
        out_dir=Path(args.out),
        commit=args.commit,
        gpu=torch.cuda.get_device_name(),
        config=run_config(args, sweep),
        bandwidth=bandwidth,
        correctness=correctness,
        started=started,
        flops_per_s=flops_per_s,
    )
    if "sampler" in sweep.extras:
        report.studies["sampler_paths"] = sampler_paths(sweep.batches)

    run = DecodeRun(args, sweep, report)
    for name in sweep.models:
        try:
            run.time_model(name)
        except Exception as exc:  # keep the other model's rows; say what broke
            report.notes.append(f"{name} failed: {type(exc).__name__}: {exc}"[:600])
            traceback.print_exc()
            torch.cuda.empty_cache()

    out, rows, ratios = report.write(complete=True)
    print(f"\nwrote {out}; notes: {report.notes}")
    print_table(rows, ratios)
    print_targets(targets(rows, ratios))
