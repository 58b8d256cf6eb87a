"""Multi-LoRA decode cost in the engine: `Engine.step()` TPOT at batch 32 (context ~512) with
base-only rows, with every row on one of 8 adapters, and mixed (every other row an adapter),
CUDA graphs on, for LoRA on q/k/v/o and on all linear projections.

Per target set: a Llama-3-8B-shaped model (seeded random bf16 weights), a `MultiLoraRuntime`
with `adapters` slots of rank `rank` (adapters written in PEFT format with random A and B, one
distinct adapter per slot), and an engine whose KV storage holds random values. `batch`
sequences are injected with `context - 1` tokens treated as cached, so every step is a decode
step; TPOT is the wall time of `Engine.step()` (scheduling, staging, graph replay, sampling, the
host sync) and `graph_replay_ms` the graph alone (CUDA events). Adapter steps replay the LoRA
graph (the fused step plus one shrink GEMM and one expand kernel per adapted projection group).

Before timing, an adapter step's logits are checked against the engine's previous LoRA path
(the eager `runtime.forward` over the same buffers): base rows must be bit-identical to the base
step, adapter rows must differ from the eager LoRA logits by about as little as the base rows of
the two paths do (kernel rounding), much less than the adapters' own effect. That previous path
is also timed (`system` `harli_eager_lora`, forward only) for comparison.

Run: `python -m bench.multilora --out DIR` (about 60 s on an H200);
`--model tiny --device cpu` is a smoke run (no graphs, no fused kernels on CPU).

This module runs the benchmark; beside it: ``args`` (the command line),
``setup`` (model, adapters, runtime and engine per target set), ``measure``
(the check and the timed steps per mix) and ``report`` (rows, the result file, the
table).
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.multilora.args import parse_args
from bench.multilora.measure import run_targets
from bench.multilora.report import check_key, print_table, result_document, result_path
from bench.multilora.setup import MODES, RunSizes, build_model
from gpu_runtime.model import CausalLM


def run_multilora(
    model: CausalLM,
    *,
    batch: int = 32,
    context: int = 512,
    adapters: int = 8,
    rank: int = 16,
    targets: tuple[str, ...] = ("qkvo", "all"),
    steps: int = 50,
    warmup: int = 5,
    modes: tuple[str, ...] = MODES[:1],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """All rows and the correctness checks per target set and mode (checks keyed `targets`
    for the default mode, `targets/mode` otherwise); what `bench/finetune/run.py` calls."""
    device = model.lm_head.weight.device
    sizes = RunSizes(batch, context, adapters, rank, steps, warmup)
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in targets:
            for mode in modes:
                target_rows, checks[check_key(name, mode)] = run_targets(
                    model,
                    name,
                    sizes,
                    device=device,
                    adapter_root=Path(tmp),
                    mode=mode,
                )
                rows.extend(target_rows)
    return rows, checks


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    started = time.perf_counter()
    device = torch.device(args.device)
    model, dtype = build_model(args.model, device)
    targets = tuple(t for t in args.targets.split(",") if t)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = result_path(args.out, gpu)
    sizes = RunSizes(args.batch, args.context, args.adapters, args.rank, args.steps, args.warmup)
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        modes = [m for m in args.modes.split(",") if m]
        for mode, name in [(m, t) for m in modes for t in targets]:  # file rewritten per set
            try:
                target_rows, checks[check_key(name, mode)] = run_targets(
                    model,
                    name,
                    sizes,
                    device=device,
                    adapter_root=Path(tmp),
                    profile=args.profile,
                    mode=mode,
                    mixed_step_rows=args.mixed_steps and not rows,
                )
            except Exception as exc:  # keep the other sets' rows; say what broke
                import traceback

                traceback.print_exc()
                checks[check_key(name, mode)] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                target_rows = []
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.extend({"model": args.model} | r for r in target_rows)
            result = result_document(
                args, gpu=gpu, dtype=dtype, checks=checks, rows=rows, started=started
            )
            out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out} in {time.perf_counter() - started:.1f} s")
    print_table(rows, checks)
