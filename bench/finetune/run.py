"""LoRA finetune speed and memory on one GPU: our trainer vs HF transformers + PEFT, plus the
cost of batched multi-LoRA in a decode step.

Training (per LoRA targets x sequence length x micro-batch): Llama-3-8B shape, seeded random bf16
weights, rank 16, alpha 32, dropout 0.05, bf16 autocast, fused AdamW over fp32 adapter
parameters, gradient clipping at 1.0, one optimizer step per micro-batch, every token but the
first a loss target. Ours: `LoraTrainer.step_quantum` over the serving model's own tensors
(fused q|k|v and gate|up, as the decode engine keeps them), each micro-batch's forward and
backward replayed from a CUDA graph (the trainer's default on CUDA; `harli_eager` is the same
trainer with `cuda_graphs=False`, the first two quanta of a graphed row are its warm-up and
capture). Reference: a plain torch loop over
`peft.get_peft_model(LlamaForCausalLM)` built on the same tensors (no second copy in this run;
a separate HF+PEFT process would need its own copy of the base weights, hence
`extra_mem_on_decode_gpu_gb`). Both see the same token ids. Before timing, the first losses of
both (adapters start at B = 0, so both equal the base model's loss) are compared.

Timing: `--warmup` steps, then `--steps` steps each timed on the host after the step's sync
(ours syncs once per quantum; HF reads `loss.item()`); tokens/s = tokens per step / median step.

A row's `graph_modes` says how each timed quantum ran: the first quantum on a stream runs eagerly
(warm-up), the first of each shape after it captures, the rest replay.

Multi-LoRA decode (`multi_lora_decode`, through `bench/multilora/run.py`): `Engine.step()` TPOT at
batch 32, context 512, CUDA graphs on CUDA: base-only rows, every row on one of 8 adapters (rank
16), and mixed, for q/k/v/o and all-linear LoRA (see that file's docstring).

Run: `python -m bench.finetune` (see --help; `--model tiny --device cpu` is a
smoke run). Writes `<out>/finetune-<gpu>-<yyyymmdd>.json` after every row and prints a table last.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.provenance import gpu_slug
from bench.common.samples import sample_percentile
from bench.finetune.args import TARGETS, parse_args, plan_rows
from bench.finetune.report import print_tables, write_result
from bench.finetune.runs import (
    GB,
    hf_peft_model,
    multi_lora_decode,
    peak,
    random_examples,
    reset_peak,
    run_hf,
    run_ours,
)
from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.model import ModelConfig, build_random_model


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # smoke runs on a shared machine
    config = ModelConfig.preset(args.model).replace(dtype="bfloat16")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    serving = build_random_model(config, seed=0, device=device, dtype=dtype)
    serving.fuse_projections()  # as the decode engine keeps it
    base_bytes = sum(p.numel() * p.element_size() for p in serving.parameters())
    rows: list[dict[str, Any]] = []
    decode_rows: list[dict[str, Any]] = []
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    out = Path(args.out) / f"finetune-{gpu_slug(gpu)}-{day}.json"

    def write() -> dict[str, Any]:
        return write_result(out, args, config, gpu, base_bytes, rows, decode_rows, started)

    plan = plan_rows(args)
    first_losses: dict[tuple[str, int, int], float] = {}
    hf_models: dict[str, Any] = {}
    for targets, seq, micro, system in plan:
        spec = LoraSpec(
            rank=args.rank, alpha=2 * args.rank, dropout=0.05, target_modules=TARGETS[targets]
        )
        count = micro * (args.warmup + args.steps)
        examples = random_examples(config.vocab_size, count, seq, seed=seq + micro)
        baseline = reset_peak(device)
        row: dict[str, Any] = {
            "model": args.model,
            "system": system,
            "targets": targets,
            "seq_len": seq,
            "micro_batch": micro,
            "lora_rank": args.rank,
        }
        if time.perf_counter() - started > args.time_budget_s:
            row["status"] = "skipped: time budget"
            rows.append(row)
            continue
        try:
            if system == "hf_peft":
                fresh = targets not in hf_models  # adapters at B = 0: first loss is the base's
                if fresh:
                    hf_models[targets] = hf_peft_model(serving, spec, device)
                baseline = reset_peak(device)
                times, losses = run_hf(hf_models[targets], examples, micro, args.warmup, device)
            else:
                times, losses, info = run_ours(
                    serving, spec, examples, micro, args.warmup, variant=system
                )
                row.update(info)
            step = statistics.median(times)
            peak_bytes = peak(device)
            training = (peak_bytes - baseline) / GB
            row.update(
                {
                    "status": "ok",
                    "tokens_per_s": round(micro * seq / step, 1),
                    "step_ms_p50": round(step * 1e3, 2),
                    "step_ms_p99": round(sample_percentile(times, 99) * 1e3, 2),
                    "peak_mem_gb": round(peak_bytes / GB, 3),
                    "training_mem_gb": round(training, 3),
                    "extra_mem_on_decode_gpu_gb": round(
                        training + (base_bytes / GB if system == "hf_peft" else 0.0), 3
                    ),
                    "first_loss": round(losses[0], 5),
                    "last_loss": round(losses[-1], 5),
                }
            )
            key = (targets, seq, micro)
            if system == "hf_peft" and not fresh:
                pass  # the reused HF adapters were trained by earlier rows
            elif key in first_losses:
                row["first_loss_rel_diff"] = abs(losses[0] - first_losses[key]) / first_losses[key]
            else:
                first_losses[key] = losses[0]
        except torch.cuda.OutOfMemoryError:
            row["status"] = "oom"
        except Exception as exc:  # keep the other rows of a one-shot GPU run
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
        write()
    if not args.no_decode:
        reset_peak(device)
        try:
            decode_rows.extend(multi_lora_decode(serving, 32, 8, args.rank, 50, device))
        except Exception as exc:  # keep the training rows
            decode_rows.append({"system": "harli_multi_lora", "status": f"error: {exc}"[:300]})
        for row in decode_rows:
            print(json.dumps(row), flush=True)
    result = write()
    print_tables(out, result, rows, decode_rows)
