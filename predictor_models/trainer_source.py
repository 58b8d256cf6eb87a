"""Finetune quanta from the finetune engine's own trainer, for stage-2 profiling.

``TrainerQuanta`` keeps one :class:`~gpu_runtime.finetune.trainer.LoraTrainer` per (LoRA rank,
sequence length) over the serving model's shared base weights, training on synthetic examples of
exactly that length (uniform random tokens, every token a target), optimizer batch 8, LoRA
dropout 0 (as the co-location bench runs its jobs). A quantum is what the co-location scheduler
launches: ``trainer.step_quantum(max_examples=m)``, one micro-batch of ``m`` examples, forward
and backward replayed from the trainer's CUDA graph for that shape and stream, the optimizer step
at each batch's end, and the quantum's one host sync.

``TrainerQuantum.warm(stream)`` runs quanta on ``stream`` (the finetune partition's) until one
replays its graph (the first micro-batch on a stream runs eagerly, the next captures), and times
that replay: the quantum alone. ``run()`` is one more quantum on the current stream; it blocks
until the quantum finishes (the trainer's host sync), as on the scheduler's worker thread.
``release()`` drops the trainer's graphs (their pool goes back once ``empty_cache`` runs).
On CPU (tests) the trainer runs eagerly and ``warm`` accepts graph mode ``"off"``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_runtime.contract.hparams import FinetuneHyperparameters, LoraSpec
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.quantum import QuantumResult
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM

OPTIMIZER_BATCH = 8
"""Examples per optimizer step; micro-batches of 1, 2, 4 or 8 examples never straddle one."""
N_EXAMPLES = 128
N_EPOCHS = 50
FINETUNE_MODE = (
    "gpu_runtime.finetune.trainer.LoraTrainer.step_quantum(max_examples=m) on the finetune "
    "partition's stream (the serving model's shared weights, fused training forward): one "
    "micro-batch of m synthetic examples of seq_len tokens, forward+backward replayed from the "
    "trainer's CUDA graph for (shape, stream), optimizer step every 8 examples, one host sync "
    "per quantum; quanta run back to back from the profiler's thread (ft_backward = 1: a whole "
    "micro-batch, as the scheduler describes its quanta)"
)


class TrainerQuantumError(RuntimeError):
    """A trainer quantum did not run as the scheduler's would (e.g. no graph replay)."""


def synthetic_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[TokenizedExample]:
    """``n`` examples of exactly ``seq_len`` uniform random tokens, every token a target."""
    ids = np.random.default_rng(seed).integers(0, vocab, (n, seq_len))
    return [TokenizedExample(tuple(row), tuple(row)) for row in ids.tolist()]


class TrainerQuantum:
    """Quanta of ``micro_batch`` examples from one trainer (see the module docstring)."""

    def __init__(self, trainer: LoraTrainer, micro_batch: int) -> None:
        if OPTIMIZER_BATCH % micro_batch:
            raise ValueError(f"micro_batch {micro_batch} must divide {OPTIMIZER_BATCH}")
        self.trainer, self.micro_batch = trainer, micro_batch
        self.modes: list[str] = []
        """Graph mode of every quantum run (``QuantumResult.graph``)."""

    def run(self) -> QuantumResult:
        """One quantum on the current stream (returns after its host sync)."""
        result = self.trainer.step_quantum(max_examples=self.micro_batch)
        if result.examples != self.micro_batch:
            raise TrainerQuantumError(
                f"quantum ran {result.examples} examples, expected {self.micro_batch}"
            )
        self.modes.append(result.graph)
        return result

    def warm(self, stream: Any, tries: int = 4) -> float:
        """Run quanta on ``stream`` (None: the current one, CPU) until one replays its graph;
        returns that quantum's ms (CUDA events on ``stream``; wall time without a stream).

        TrainerQuantumError if graphs are in use but no quantum replayed within ``tries``
        (e.g. a failed capture: the trainer's quanta would run eagerly, host-bound)."""
        self.align(stream)
        result = None
        for _ in range(tries):
            if stream is None:
                result = self.run()
                if result.graph in ("replay", "off"):
                    return result.wall_s * 1e3
                continue
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                result = self.run()
                end.record(stream)
            if result.graph in ("replay", "off"):
                end.synchronize()
                return float(start.elapsed_time(end))
        raise TrainerQuantumError(
            f"no graph replay after {tries} quanta: the last ran "
            f"{result.graph if result else None} ({result.graph_fallback if result else None})"
        )

    def align(self, stream: Any) -> None:
        """If the trainer last ran quanta of another size and stopped where ``micro_batch``
        examples no longer fit before the optimizer batch's end, run the rest of that batch
        (one quantum): every later quantum then has exactly ``micro_batch`` examples."""
        rest = self.trainer.stream.position.index % OPTIMIZER_BATCH
        if rest % self.micro_batch:
            if stream is None:
                self.trainer.step_quantum(max_examples=OPTIMIZER_BATCH - rest)
                return
            with torch.cuda.stream(stream):
                self.trainer.step_quantum(max_examples=OPTIMIZER_BATCH - rest)

    def check_replayed(self, since: int) -> None:
        """TrainerQuantumError unless every quantum after the first ``since`` replayed."""
        modes = set(self.modes[since:]) - {"replay", "off"}
        if modes:
            raise TrainerQuantumError(f"co-run quanta ran {sorted(modes)}, not graph replays")


class TrainerQuanta:
    """Trainers per (rank, seq_len) over one serving model, built when first asked for."""

    def __init__(self, model: CausalLM, seed: int = 0) -> None:
        self.model = model
        self.seed = seed
        self.trainers: dict[tuple[int, int], LoraTrainer] = {}

    def quantum(self, rank: int, seq_len: int, micro_batch: int) -> TrainerQuantum:
        """Quanta of ``micro_batch`` x ``seq_len`` tokens at LoRA rank ``rank``."""
        key = (rank, seq_len)
        trainer = self.trainers.get(key)
        if trainer is None or trainer.finished:
            if trainer is not None:
                trainer.release_cuda_graphs()
            hparams = FinetuneHyperparameters(
                n_epochs=N_EPOCHS,
                batch_size=OPTIMIZER_BATCH,
                learning_rate=1e-4,
                lora=LoraSpec(rank=rank, alpha=32.0, dropout=0.0),
                seed=self.seed + rank,
                max_seq_len=seq_len,
                warmup_ratio=0.0,
            )
            vocab = self.model.config.vocab_size
            examples = synthetic_examples(N_EXAMPLES, seq_len, vocab, self.seed + seq_len)
            trainer = LoraTrainer(self.model, examples, hparams, max_cuda_graphs=8)
            self.trainers[key] = trainer
        return TrainerQuantum(trainer, micro_batch)

    def release(self) -> None:
        """Drop every trainer's graphs (their pools go back after ``empty_cache``)."""
        for trainer in self.trainers.values():
            trainer.release_cuda_graphs()

    def describe(self) -> dict[str, Any]:
        """Optimizer steps and graph counters per trainer (for the profile's metadata)."""
        out: dict[str, Any] = {}
        for (rank, seq_len), trainer in self.trainers.items():
            graphs = trainer.graphs
            out[f"rank{rank}-seq{seq_len}"] = {
                "optimizer_steps": trainer.step,
                "graph_counts": dict(graphs.counts) if graphs is not None else None,
                "graphs_disabled": graphs.disabled if graphs is not None else None,
            }
        return out
