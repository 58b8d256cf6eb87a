"""Profiler: decode-iteration latency alone (stage 1) and beside a finetune quantum (stage 2).

Run on the GPU host::

    python -m predictor_models.profile --model llama3-8b --out DIR \
        --stage1-s 50 --stage2-s 70 --commit <sha>

It samples random configurations (seeded) until each stage's time budget is spent, so whole
configurations (not rows of one) differ: batch size log-uniform in 1..256, mean context
log-uniform in 32..4096 with per-sequence jitter of +-50%, a chunked-prefill piece of 0/64/256/512
tokens, and a decode SM count from the partition table (or the whole device, time-shared).
Each sample captures one decode iteration as a CUDA graph on the partition's decode stream and
times ``--iters`` replays (after 3 warm-ups) with CUDA events: one stage-1 row (median, p90).
Stage 2 (``--finetune trainer``, the default) warms a quantum of the finetune engine's own
trainer (``LoraTrainer.step_quantum``: one micro-batch, forward+backward replayed from its CUDA
graph, tokens, sequence length and rank drawn at random, tokens at most 4096 x the finetune SM
share) on the partition's finetune stream, then times ``--decode-per-quantum`` decode
configurations alone and beside quanta run back to back until every timed decode replay has
finished (``predictor_models.trainer_source``). ``--finetune peft`` runs the older stand-in
quantum instead: a peft LoRA forward (a captured CUDA graph) then backward (eager autograd),
two in flight, one row per phase. A row is kept only if the finetune stream had work during at
least 80% of the decode window (``ft_busy_frac``); it records the quantum's own duration alone
and beside decode.

A deployment's engine (``--max-num-seqs``, ``--max-batched-tokens``, ``--graph-batch-sizes``,
``--max-model-len``, ``--decode-groups``, ``--mixed-graphs``) with ``--chunk-share`` draws steps
from ``predictor_models.sampling.sample_step`` instead: batches up to ``--max-num-seqs``, prompt
chunks of every size up to the token budget (some after a cached prefix, some two per step),
each row recording the token bucket it ran at. ``--device cpu`` runs the same path on a tiny
model with wall-clock timings (a dry run of a device script).

Writes ``profile-<gpu>-<model>.csv`` (columns: ``ROW_FIELDS``) and ``.meta.json`` (GPU, model
shape, commit, source of the decode workload, sharing mechanism, budgets).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import faulthandler
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.sharing import GpuSharing, create_sharing
from predictor_models.profiler import (
    DECODE_GROUPS,
    FINETUNE_MODE,
    ROW_FIELDS,
    SOURCE,
    SOURCES,
    Profiler,
)
from predictor_models.sampling import StepSpace, sample_decode, sample_finetune
from predictor_models.timing import CpuSharing
from predictor_models.trainer_source import FINETUNE_MODE as TRAINER_MODE

__all__ = ["ROW_FIELDS", "Profiler", "RowWriter", "main", "sample_decode", "sample_finetune"]


def _commit(arg: str | None) -> str:
    if arg:
        return arg
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class RowWriter:
    """Appends rows to ``<stem>.csv`` as they are measured (a crash keeps what was written)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        with path.open("w", newline="") as handle:
            csv.DictWriter(handle, fieldnames=ROW_FIELDS).writeheader()
        self.written = 0

    def flush(self, rows: list[dict[str, Any]]) -> None:
        with self.path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=ROW_FIELDS)
            for row in rows[self.written :]:
                writer.writerow(
                    {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()}
                )
        self.written = len(rows)


def _ints(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(v) for v in text.split(",") if v) if text else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--model", default="llama3-8b")
    add("--out", default="predictor_models/data")
    add("--stages", default="12", help="which stages to run, in order: 1, 2, 12 or 21")
    add("--stage1-s", type=float, default=50.0)
    add("--stage2-s", type=float, default=70.0)
    add("--iters", type=int, default=12)
    add("--max-kv-tokens", type=int, default=262144)
    add("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run (tiny model)")
    add("--sharing", default="green_context", choices=("green_context", "streams"))
    add("--decode-groups", default=None, help="decode SMs / 8 per split (default 4,6,..,14)")
    add("--decode-source", default="engine", choices=("engine", "standin"))
    add(
        "--prefill-choices",
        default=None,
        help="comma-separated prefill-chunk sizes drawn per sample (default: engine 0; "
        "standin 0,0,0,0,64,256,512); ignored with --chunk-share",
    )
    add("--stage2-prefill-choices", default=None, help="the same for stage 2 (default: stage 1's)")
    add(
        "--finetune",
        default="trainer",
        choices=("trainer", "peft"),
        help="stage-2 quanta: the finetune engine's LoraTrainer.step_quantum (graphed micro-"
        "batches) or the peft LoRA forward/backward of predictor_models.standin",
    )
    add(
        "--decode-per-quantum",
        type=int,
        default=3,
        help="trainer mode: decode configurations timed beside each warmed quantum",
    )
    add(
        "--mixed-graphs",
        action="store_true",
        help="engine source: steps with a prefill chunk replay the engine's piecewise mixed-step "
        "graphs (EngineConfig.mixed_cuda_graphs) instead of launching eagerly",
    )
    group = parser.add_argument_group(
        "deployment (engine source)", "the served engine's EngineConfig and the steps it runs"
    )
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-batched-tokens", type=int, default=None)
    group.add_argument("--graph-batch-sizes", default=None, help="decode buckets, e.g. 1,2,4,8")
    group.add_argument("--max-model-len", type=int, default=8192)
    group.add_argument(
        "--chunk-share",
        type=float,
        default=None,
        help="draw steps with predictor_models.sampling.sample_step: this share of stage-1 "
        "steps carry prompt chunks (log-uniform sizes up to the token budget)",
    )
    group.add_argument("--stage2-chunk-share", type=float, default=0.0)
    group.add_argument("--chunk-min", type=int, default=16)
    group.add_argument("--prefix-share", type=float, default=0.0)
    group.add_argument("--two-chunk-share", type=float, default=0.0)
    group.add_argument("--context-max", type=float, default=4096.0, help="largest mean context")
    add("--tag", default="", help="suffix of the output file names")
    add("--trace", action="store_true", help="print each step of each sample")
    add("--seed", type=int, default=0)
    add("--commit", default=None)
    return parser


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = _parser().parse_args()
    faulthandler.enable()  # a native crash still prints where it happened
    groups = _ints(args.decode_groups) or DECODE_GROUPS
    sharing: GpuSharing
    if args.device == "cpu":
        device = torch.device("cpu")
        sharing = CpuSharing(groups)
        gpu_name, sms = "cpu", sharing.table.total_sms
    else:
        device = torch.device("cuda", 0)
        sharing = create_sharing(device, prefer=args.sharing, decode_groups=groups)
        props = torch.cuda.get_device_properties(device)
        gpu_name, sms = props.name, props.multi_processor_count
    engine_options: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
        "graph_batch_sizes": _ints(args.graph_batch_sizes),
        "max_model_len": args.max_model_len,
    }
    profiler = Profiler(
        args.model,
        sharing,
        args.max_kv_tokens,
        args.iters,
        args.seed,
        args.decode_source,
        args.finetune,
        args.mixed_graphs,
        engine_options if args.decode_source == "engine" else None,
    )
    profiler.trace = args.trace
    profiler.decode_per_quantum = max(1, args.decode_per_quantum)
    if args.prefill_choices:
        profiler.prefill_choices = _ints(args.prefill_choices) or (0,)
    if args.stage2_prefill_choices:
        profiler.stage2_prefill_choices = _ints(args.stage2_prefill_choices)
    engine_config = getattr(profiler.decode, "config", None)
    if args.chunk_share is not None:
        budget = engine_config.max_num_batched_tokens if engine_config else 8192
        profiler.space = StepSpace(
            max_batch=min(args.max_num_seqs, 256),
            context_range=(32.0, args.context_max),
            max_model_len=args.max_model_len,
            token_budget=budget,
            chunk_share=args.chunk_share,
            chunk_min=args.chunk_min,
            prefix_share=args.prefix_share,
            prefix_max=min(1024, args.max_model_len // 2),
            two_chunk_share=args.two_chunk_share,
        )
        profiler.stage2_space = StepSpace(
            **{**profiler.space.__dict__, "chunk_share": args.stage2_chunk_share}
        )
    gpu = gpu_name.split()[-1].lower()
    stem = f"profile-{gpu}-{args.model}{'-' + args.tag if args.tag else ''}"
    out = Path(args.out)
    meta: dict[str, Any] = {
        "gpu": gpu_name,
        "gpu_key": gpu,
        "sms": sms,
        "torch": torch.__version__,
        "commit": _commit(args.commit),
        "created": dt.datetime.now(dt.UTC).isoformat(),
        "model": args.model,
        "model_shape": profiler.shape.as_dict(),
        "source": SOURCES.get(args.decode_source, SOURCE),
        "finetune_mode": TRAINER_MODE if args.finetune == "trainer" else FINETUNE_MODE,
        "sharing": sharing.mechanism,
        "mixed_cuda_graphs": args.mixed_graphs,
        "decode_sms_choices": list(sharing.table.choices),
        "iters_per_row": args.iters,
        "seed": args.seed,
        "stages": args.stages,
        "prefill_choices": list(profiler.prefill_choices),
        "stage2_prefill_choices": list(profiler.stage2_prefill_choices or profiler.prefill_choices),
        "step_space": profiler.space.__dict__ if profiler.space else None,
        "stage2_step_space": profiler.stage2_space.__dict__ if profiler.stage2_space else None,
        "budgets_s": [args.stage1_s, args.stage2_s],
        "fields": list(ROW_FIELDS),
        "errors": [],
    }
    if engine_config is not None:
        meta["engine"] = {
            "block_size": engine_config.block_size,
            "max_num_seqs": engine_config.max_num_seqs,
            "max_num_batched_tokens": engine_config.max_num_batched_tokens,
            "max_model_len": engine_config.max_model_len,
            "graph_batch_sizes": list(engine_config.graph_batch_sizes()),
            "mixed_cuda_graphs": engine_config.mixed_cuda_graphs,
            "mixed_graph_token_sizes": list(engine_config.mixed_graph_token_sizes()),
            # attention of steps with prompt chunks ("varlen" or "sdpa"); None for an engine
            # without the field
            "chunk_attention": getattr(engine_config, "chunk_attention", None),
        }
    (out / f"{stem}.meta.json").parent.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.meta.json").write_text(json.dumps(meta, indent=1))
    writer = RowWriter(out / f"{stem}.csv")
    rng = random.Random(args.seed * 1000 + int(args.stages))
    errors: list[str] = []
    meta["errors"] = errors
    budgets = {1: args.stage1_s, 2: args.stage2_s}
    usable = True
    started = time.monotonic()
    for stage in [int(c) for c in args.stages if c in "12"]:  # in the order given ("21")
        budget = budgets[stage]
        deadline = time.monotonic() + budget
        stage_errors = 0
        while usable and time.monotonic() < deadline and stage_errors <= 20:
            try:
                profiler.stage1_sample(rng) if stage == 1 else profiler.stage2_sample(rng)
            except Exception as exc:  # keep the data gathered so far (Triton errors included)
                stage_errors += 1
                errors.append(f"stage {stage}: {type(exc).__name__}: {str(exc)[:300]}")
                print("ERROR", errors[-1], flush=True)
                _drop_failing_chunks(profiler, errors)
                try:
                    _sync(device)
                except Exception as sync_exc:  # a sticky CUDA error: nothing more can run
                    errors.append(f"stage {stage}: CUDA unusable: {str(sync_exc)[:300]}")
                    usable = False
            writer.flush(profiler.rows)
    meta["profile_s"] = round(time.monotonic() - started, 1)
    if profiler.quanta is not None:
        meta["trainers"] = profiler.quanta.describe()
    (out / f"{stem}.meta.json").write_text(json.dumps(meta, indent=1))
    _summary(profiler.rows, writer.path, len(errors))


def _drop_failing_chunks(profiler: Profiler, errors: list[str]) -> None:
    """After 3 steps with prompt chunks that did not replay the mixed-step graphs, draw
    decode-only steps for the rest of the run (their rows are still worth the device time)."""
    eager = sum("ran eagerly" in e for e in errors)
    if eager >= 3 and profiler.space is not None and profiler.space.chunk_share:
        profiler.space = dataclasses.replace(profiler.space, chunk_share=0.0)
        errors.append("prompt chunks dropped after 3 eager mixed steps: decode-only from here")
        print("ERROR", errors[-1], flush=True)


def _summary(rows: list[dict[str, Any]], path: Path, n_errors: int) -> None:
    n1 = sum(1 for r in rows if r["stage"] == 1)
    chunk = sum(1 for r in rows if r["stage"] == 1 and r["prefill_chunk_tokens"])
    print(
        f"wrote {path}: {n1} stage-1 rows ({chunk} with prompt chunks), "
        f"{len(rows) - n1} stage-2 rows, {n_errors} errors"
    )
    keys = ("stage", "decode_sms", "batch_size", "context_tokens_mean", "prefill_chunk_tokens")
    for row in rows[:: max(1, len(rows) // 20)]:
        print({k: row[k] for k in (*keys, "padded_tokens", "ft_tokens", "latency_ms")})


if __name__ == "__main__":
    main()
