"""Profiler: decode-iteration latency alone (stage 1) and beside a finetune quantum (stage 2).

Run on the GPU host::

    PYTHONPATH=. python3 -m predictor_models.profile --model llama3-8b --out DIR \
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

Writes ``profile-<gpu>-<model>.csv`` (columns: ``ROW_FIELDS``) and ``.meta.json`` (GPU, model
shape, commit, source of the decode workload, sharing mechanism, budgets).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import faulthandler
import json
import math
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.model import ModelConfig, build_random_model
from gpu_runtime.predictor.schema import NO_FINETUNE_ROW, STAGE2_FEATURES, ModelShape
from gpu_runtime.sharing import GpuSharing, create_sharing
from predictor_models.standin import LoraQuantum, StandInDecode
from predictor_models.timing import corun, time_fn, time_graph
from predictor_models.trainer_source import FINETUNE_MODE as TRAINER_MODE

EXTRA_FIELDS = (
    "stage",
    "source",
    "mechanism",
    "decode_sms",
    "total_sms",
    "latency_ms",
    "latency_ms_p90",
    "n_iters",
    "ft_quantum_ms_alone",
    "ft_quantum_ms_colocated",
    "ft_busy_frac",
)
ROW_FIELDS: tuple[str, ...] = STAGE2_FEATURES + EXTRA_FIELDS
DECODE_GROUPS = (4, 6, 8, 10, 12, 14)  # decode 32..112 SMs in steps of 16, plus the device
SOURCES = {
    "engine": (
        "engine: gpu_runtime.engine ModelRunner decode step (fused Triton kernels, Triton paged "
        "attention, block size 16) replayed from its CUDA graph per (bucket, partition); "
        "iterations with a prefill chunk run the runner's eager general path "
        "(ModelRunner._general_logits, the fused step with mixed paged attention on CUDA); "
        "finetune: see finetune_mode"
    ),
}
FINETUNE_MODE = (
    "predictor_models.standin.LoraQuantum (peft LoRA on the serving model's weights): forward "
    "replayed from a CUDA graph, backward eager autograd; two quanta kept in flight on the "
    "finetune stream; not the finetune engine's trainer (no optimizer step, no fixed host "
    "overhead between quanta)"
)
SOURCE = (
    "stand-in: gpu_runtime.model CausalLM forward + padded grouped-query KV attention, "
    "CUDA graph per (config, partition); finetune = peft LoRA fwd/bwd on shared weights"
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sample_decode(
    rng: random.Random,
    max_kv_tokens: int,
    prefill_choices: tuple[int, ...] = (0, 0, 0, 0, 64, 256, 512),
) -> tuple[list[int], int]:
    """Per-sequence contexts and prefill-chunk tokens of one random iteration."""
    while True:
        batch = max(1, round(math.exp(rng.uniform(0.0, math.log(256)))))
        mean = math.exp(rng.uniform(math.log(32), math.log(4096)))
        contexts = [max(1, round(mean * rng.uniform(0.5, 1.5))) for _ in range(batch)]
        if batch * (max(contexts) + 1) <= max_kv_tokens:
            return contexts, rng.choice(prefill_choices)


def sample_finetune(rng: random.Random, max_tokens: int = 4096) -> tuple[int, int, int]:
    """(tokens, seq_len, lora_rank) of one random quantum: ``micro_batch`` (1, 2, 4 or 8)
    examples of ``seq_len`` tokens, at most ``max_tokens`` (at least one 256-token example)."""
    seq_len = rng.choice([s for s in (256, 512, 1024, 2048) if s <= max(max_tokens, 256)])
    micro_batch = rng.choice([m for m in (1, 2, 4, 8) if m * seq_len <= max(max_tokens, seq_len)])
    return micro_batch * seq_len, seq_len, rng.choice((8, 16, 64))


class Profiler:
    """Drives decode graphs and LoRA quanta on the streams of one ``GpuSharing``."""

    def __init__(
        self,
        model_name: str,
        sharing: GpuSharing,
        max_kv_tokens: int,
        iters: int,
        seed: int,
        source: str = "standin",
        finetune: str = "peft",
        mixed_graphs: bool = False,
    ) -> None:
        self.device = sharing.device
        self.seed = seed
        config = ModelConfig.preset(model_name)
        self.shape = ModelShape.from_model_config(config, name=model_name)
        self.model = build_random_model(config, seed=seed, device=self.device, dtype=torch.bfloat16)
        self.model.fuse_projections()
        self.source = source
        self.decode: Any
        if source == "engine":
            from predictor_models.engine_source import EngineDecode

            self.decode = EngineDecode(self.model, max_kv_tokens, seed, mixed_graphs)
            self.prefill_choices: tuple[int, ...] = (0,)
        elif source == "standin":
            self.decode = StandInDecode(self.model, max_kv_tokens, seed=seed)
            self.prefill_choices = (0, 0, 0, 0, 64, 256, 512)
        else:
            raise ValueError(f"unknown decode source {source!r}; expected engine or standin")
        self.stage2_prefill_choices: tuple[int, ...] | None = None  # None: prefill_choices
        if finetune not in ("peft", "trainer"):
            raise ValueError(f"unknown finetune mode {finetune!r}; expected peft or trainer")
        self.finetune = finetune
        self.quanta: Any = None  # TrainerQuanta, built on the first trainer sample
        self.decode_per_quantum = 3  # trainer mode: decode configurations per warmed quantum
        self.sharing = sharing
        self.iters = iters
        self.trees: dict[int, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.trace = False

    def _log(self, message: str) -> None:
        if self.trace:
            print(f"[{time.monotonic():.1f}] {message}", flush=True)

    def _tree(self, rank: int) -> Any:
        if rank not in self.trees:
            from gpu_runtime.finetune.hparams import LoraSpec
            from gpu_runtime.finetune.lora import build_training_model

            self.trees[rank] = build_training_model(self.model, LoraSpec(rank=rank), seed=rank)
        return self.trees[rank]

    def _row(
        self,
        stage: int,
        decode_sms: int,
        contexts: list[int],
        prefill: int,
        times: list[float],
        ft: tuple[float, ...] = NO_FINETUNE_ROW,
        ft_ms: tuple[float | str, float | str] = ("", ""),
    ) -> dict[str, Any]:
        info = self.sharing.info(decode_sms)
        total = self.sharing.table.total_sms
        features = [
            len(contexts),
            sum(contexts),
            sum(contexts) / len(contexts),
            max(contexts),
            prefill,
            decode_sms / total,
            *ft,
        ]
        row: dict[str, Any] = dict(zip(STAGE2_FEATURES, features, strict=True))
        row.update(
            stage=stage,
            source=self.source,
            mechanism=self.sharing.mechanism if info.spatial else "streams",
            decode_sms=decode_sms,
            total_sms=total,
            latency_ms=statistics.median(times),
            latency_ms_p90=_pct(times, 0.9),
            n_iters=len(times),
            ft_quantum_ms_alone=ft_ms[0],
            ft_quantum_ms_colocated=ft_ms[1],
            ft_busy_frac="",
        )
        self.rows.append(row)
        return row

    def stage1_sample(
        self,
        rng: random.Random,
        prefill_choices: tuple[int, ...] | None = None,
        decode_sms: int | None = None,
    ) -> tuple[Any, ...]:
        """Capture and time one random decode configuration alone (on ``decode_sms`` SMs, or
        a random partition); returns what stage 2 needs."""
        if decode_sms is None:
            decode_sms = rng.choice(self.sharing.table.choices)
        choices = self.prefill_choices if prefill_choices is None else prefill_choices
        contexts, prefill = sample_decode(rng, self.decode.max_kv_tokens, choices)
        ds, fs = self.sharing.partition(decode_sms)
        self._log(
            f"capture sms={decode_sms} batch={len(contexts)} max={max(contexts)} prefill={prefill}"
        )
        graph = self.decode.capture(contexts, prefill, ds, partition=decode_sms)
        ds.wait_stream(torch.cuda.current_stream(self.device))  # staged inputs before replays
        times = time_graph(graph, ds, self.iters)
        self._log(f"decode alone {statistics.median(times):.3f} ms")
        self._row(1, decode_sms, contexts, prefill, times)
        return graph, decode_sms, contexts, prefill, statistics.median(times)

    def stage2_sample(self, rng: random.Random) -> None:
        """One decode configuration beside a random LoRA quantum, forward then backward
        (peft mode), or several beside one trainer quantum (trainer mode)."""
        if self.finetune == "trainer":
            self.stage2_trainer_sample(rng)
            return
        graph, decode_sms, contexts, prefill, decode_ms = self.stage1_sample(
            rng, self.stage2_prefill_choices
        )
        tokens, seq_len, rank = sample_finetune(rng)
        ds, fs = self.sharing.partition(decode_sms)
        info = self.sharing.info(decode_sms)
        ft_share = info.finetune_sms / self.sharing.table.total_sms if info.spatial else 1.0
        self._log(f"quantum tokens={tokens} seq={seq_len} rank={rank}")
        quantum = LoraQuantum(self._tree(rank), tokens, seq_len, seed=tokens + rank)
        try:
            forward = quantum.capture_forward(fs)
            fwd = time_fn(forward, fs, 1)
            self._log(f"forward alone {fwd}")
            with torch.cuda.stream(fs):
                quantum.prepare_backward()
            bwd = time_fn(quantum.backward, fs, 1)
            self._log(f"backward alone {bwd}")
            for backward, alone_ms, fn in ((0, fwd[0], forward), (1, bwd[0], quantum.backward)):
                times, colocated, busy = corun(graph, ds, fs, fn, self.iters)
                self._log(
                    f"co-run backward={backward} {statistics.median(times):.3f} ms "
                    f"(alone {decode_ms:.3f}), finetune busy {busy:.2f}"
                )
                if busy < 0.8:
                    raise RuntimeError(
                        f"finetune stream busy only {busy:.2f} of the decode "
                        "window: co-run row dropped"
                    )
                ft = (float(tokens), float(seq_len), float(rank), float(backward), ft_share)
                row = self._row(2, decode_sms, contexts, prefill, times, ft, (alone_ms, colocated))
                row["ft_busy_frac"] = busy
        finally:
            quantum.release()
            del graph

    def stage2_trainer_sample(self, rng: random.Random) -> None:
        """Warm one trainer quantum on a random partition's finetune stream, then time
        ``decode_per_quantum`` random decode configurations alone and beside it."""
        from predictor_models.trainer_source import TrainerQuanta

        if self.quanta is None:
            self.quanta = TrainerQuanta(self.model, seed=self.seed)
        decode_sms = rng.choice(self.sharing.table.choices)
        ds, fs = self.sharing.partition(decode_sms)
        info = self.sharing.info(decode_sms)
        total = self.sharing.table.total_sms
        ft_share = info.finetune_sms / total if info.spatial else 1.0
        tokens, seq_len, rank = sample_finetune(rng, round(4096 * ft_share))
        self._log(f"trainer quantum tokens={tokens} seq={seq_len} rank={rank} sms={decode_sms}")
        quantum = self.quanta.quantum(rank, seq_len, tokens // seq_len)
        try:
            alone_ms = quantum.warm(fs)
            self._log(f"trainer quantum alone {alone_ms:.2f} ms, modes {quantum.modes}")
            for _ in range(self.decode_per_quantum):
                graph, _, contexts, prefill, decode_ms = self.stage1_sample(
                    rng, self.stage2_prefill_choices, decode_sms=decode_sms
                )
                since = len(quantum.modes)
                times, colocated, busy = corun(
                    graph, ds, fs, quantum.run, self.iters, blocking=True
                )
                quantum.check_replayed(since)
                self._log(
                    f"co-run {statistics.median(times):.3f} ms (alone {decode_ms:.3f}), "
                    f"quantum {colocated:.2f} ms, finetune busy {busy:.2f}"
                )
                if busy < 0.8:
                    raise RuntimeError(
                        f"finetune stream busy only {busy:.2f} of the decode "
                        "window: co-run row dropped"
                    )
                ft = (float(tokens), float(seq_len), float(rank), 1.0, ft_share)
                row = self._row(2, decode_sms, contexts, prefill, times, ft, (alone_ms, colocated))
                row["ft_busy_frac"] = busy
                del graph
        finally:
            self.quanta.release()
            torch.cuda.empty_cache()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--out", default="predictor_models/data")
    parser.add_argument(
        "--stages", default="12", help="which stages to run, in order: 1, 2, 12 or 21"
    )
    parser.add_argument("--stage1-s", type=float, default=50.0)
    parser.add_argument("--stage2-s", type=float, default=70.0)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--max-kv-tokens", type=int, default=262144)
    parser.add_argument("--sharing", default="green_context", choices=("green_context", "streams"))
    parser.add_argument("--decode-source", default="engine", choices=("engine", "standin"))
    parser.add_argument(
        "--prefill-choices",
        default=None,
        help="comma-separated prefill-chunk sizes drawn per sample (default: engine 0; "
        "standin 0,0,0,0,64,256,512)",
    )
    parser.add_argument(
        "--stage2-prefill-choices", default=None, help="the same for stage 2 (default: as stage 1)"
    )
    parser.add_argument(
        "--finetune",
        default="trainer",
        choices=("trainer", "peft"),
        help="stage-2 quanta: the finetune engine's LoraTrainer.step_quantum (graphed micro-"
        "batches) or the peft LoRA forward/backward of predictor_models.standin",
    )
    parser.add_argument(
        "--decode-per-quantum",
        type=int,
        default=3,
        help="trainer mode: decode configurations timed beside each warmed quantum",
    )
    parser.add_argument(
        "--mixed-graphs",
        action="store_true",
        help="engine source: steps with a prefill chunk replay the engine's piecewise mixed-step "
        "graphs (EngineConfig.mixed_cuda_graphs) instead of launching eagerly",
    )
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    parser.add_argument("--trace", action="store_true", help="print each step of each sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    faulthandler.enable()  # a native crash still prints where it happened
    device = torch.device("cuda", 0)
    sharing = create_sharing(device, prefer=args.sharing, decode_groups=DECODE_GROUPS)
    profiler = Profiler(
        args.model,
        sharing,
        args.max_kv_tokens,
        args.iters,
        args.seed,
        args.decode_source,
        args.finetune,
        args.mixed_graphs,
    )
    profiler.trace = args.trace
    profiler.decode_per_quantum = max(1, args.decode_per_quantum)
    if args.prefill_choices:
        profiler.prefill_choices = tuple(int(p) for p in args.prefill_choices.split(","))
    if args.stage2_prefill_choices:
        profiler.stage2_prefill_choices = tuple(
            int(p) for p in args.stage2_prefill_choices.split(",")
        )
    props = torch.cuda.get_device_properties(device)
    gpu = props.name.split()[-1].lower()
    stem = f"profile-{gpu}-{args.model}{'-' + args.tag if args.tag else ''}"
    out = Path(args.out)
    meta = {
        "gpu": props.name,
        "gpu_key": gpu,
        "sms": props.multi_processor_count,
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
        "budgets_s": [args.stage1_s, args.stage2_s],
        "fields": list(ROW_FIELDS),
        "errors": [],
    }
    (out / f"{stem}.meta.json").parent.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.meta.json").write_text(json.dumps(meta, indent=1))
    writer = RowWriter(out / f"{stem}.csv")
    rng = random.Random(args.seed * 1000 + int(args.stages))
    errors: list[str] = []
    meta["errors"] = errors
    budgets = {1: args.stage1_s, 2: args.stage2_s}
    usable = True
    for stage in [int(c) for c in args.stages if c in "12"]:  # in the order given ("21")
        budget = budgets[stage]
        deadline = time.monotonic() + budget
        while usable and time.monotonic() < deadline and len(errors) <= 20:
            try:
                profiler.stage1_sample(rng) if stage == 1 else profiler.stage2_sample(rng)
            except Exception as exc:  # keep the data gathered so far (Triton errors included)
                errors.append(f"stage {stage}: {type(exc).__name__}: {str(exc)[:300]}")
                print("ERROR", errors[-1], flush=True)
                try:
                    torch.cuda.synchronize()
                except Exception as sync_exc:  # a sticky CUDA error: nothing more can run
                    errors.append(f"stage {stage}: CUDA unusable: {str(sync_exc)[:300]}")
                    usable = False
            writer.flush(profiler.rows)
    if profiler.quanta is not None:
        meta["trainers"] = profiler.quanta.describe()
    (out / f"{stem}.meta.json").write_text(json.dumps(meta, indent=1))
    n1 = sum(1 for r in profiler.rows if r["stage"] == 1)
    print(
        f"wrote {writer.path}: {n1} stage-1 rows, {len(profiler.rows) - n1} stage-2 rows, "
        f"{len(errors)} errors"
    )
    for row in profiler.rows[:: max(1, len(profiler.rows) // 20)]:
        print(
            {
                k: row[k]
                for k in (
                    "stage",
                    "decode_sms",
                    "batch_size",
                    "context_tokens_mean",
                    "prefill_chunk_tokens",
                    "ft_tokens",
                    "ft_backward",
                    "latency_ms",
                )
            }
        )


if __name__ == "__main__":
    main()
