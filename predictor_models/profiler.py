"""The profiler's measuring loop: one random configuration per sample, timed alone (stage 1)
and beside finetune quanta (stage 2), on the streams of one ``GpuSharing``.

``predictor_models.profile`` is the command line around it (see its docstring); the rows it
appends are ``ROW_FIELDS``: the predictor's features (``STAGE2_FEATURES``) and what was measured.
Columns beyond the features describe the step for analysis only: ``prefill_chunks`` (prompt
chunks in the step), ``prefill_prefix_tokens`` (their prompts' tokens already cached),
``prefill_attn_pairs`` (the chunks' causal (query, key) pairs) and ``padded_tokens`` (the decode
batch bucket, or the mixed-step graph's token bucket, that the step ran at).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from gpu_runtime.model import ModelConfig, build_random_model
from gpu_runtime.predictor.schema import NO_FINETUNE_ROW, STAGE2_FEATURES, ModelShape
from gpu_runtime.sharing import GpuSharing
from predictor_models.sampling import (
    Chunks,
    StepSpace,
    attention_pairs,
    sample_decode,
    sample_finetune,
    sample_step,
)
from predictor_models.standin import LoraQuantum, StandInDecode
from predictor_models.timing import corun, time_fn, time_graph

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
    "prefill_chunks",
    "prefill_prefix_tokens",
    "prefill_attn_pairs",
    "padded_tokens",
)
ROW_FIELDS: tuple[str, ...] = STAGE2_FEATURES + EXTRA_FIELDS
DECODE_GROUPS = (4, 6, 8, 10, 12, 14)  # decode 32..112 SMs in steps of 16, plus the device
SOURCES = {
    "engine": (
        "engine: gpu_runtime.engine ModelRunner decode step (fused Triton kernels, Triton paged "
        "attention, block size 16) replayed from its CUDA graph per (bucket, partition); "
        "iterations with prompt chunks run as ModelRunner.execute runs them (ModelRunner._forward "
        "without sampling): the piecewise mixed-step graphs when mixed_cuda_graphs (see the "
        "metadata), else the eager fused step with mixed paged attention; "
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
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        """``engine_options``: ``EngineDecode`` keyword arguments (the deployment's decode
        buckets, token budget, ``max_model_len``)."""
        self.device = sharing.device
        self.seed = seed
        config = ModelConfig.preset(model_name)
        self.shape = ModelShape.from_model_config(config, name=model_name)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = build_random_model(config, seed=seed, device=self.device, dtype=dtype)
        self.model.fuse_projections()
        self.source = source
        self.decode: Any
        if source == "engine":
            from predictor_models.engine_source import EngineDecode

            self.decode = EngineDecode(
                self.model, max_kv_tokens, seed, mixed_graphs, **(engine_options or {})
            )
            self.prefill_choices: tuple[int, ...] = (0,)
        elif source == "standin":
            self.decode = StandInDecode(self.model, max_kv_tokens, seed=seed)
            self.prefill_choices = (0, 0, 0, 0, 64, 256, 512)
        else:
            raise ValueError(f"unknown decode source {source!r}; expected engine or standin")
        self.stage2_prefill_choices: tuple[int, ...] | None = None  # None: prefill_choices
        self.space: StepSpace | None = None  # set: steps drawn by sample_step (not the choices)
        self.stage2_space: StepSpace | None = None
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
            from gpu_runtime.contract.hparams import LoraSpec
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
        chunks: Chunks | None = None,
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
            prefill_chunks=len(chunks or []),
            prefill_prefix_tokens=sum(p for p, _ in chunks or []),
            prefill_attn_pairs=attention_pairs(chunks or []),
            padded_tokens=self._padded_tokens(len(contexts), prefill),
        )
        self.rows.append(row)
        return row

    def _padded_tokens(self, batch: int, prefill: int) -> int | str:
        """Tokens the step ran at: its decode bucket, or its mixed-graph token bucket ("" when
        unknown: the stand-in, an eager mixed step)."""
        config = getattr(self.decode, "config", None)
        if config is None:
            return ""
        if not prefill:
            return next((b for b in config.graph_batch_sizes() if b >= batch), "")
        if not config.mixed_cuda_graphs:
            return ""
        return next((b for b in config.mixed_graph_token_sizes() if b >= batch + prefill), "")

    def _draw(
        self, rng: random.Random, stage: int, prefill_choices: tuple[int, ...] | None
    ) -> tuple[list[int], Chunks]:
        space = self.space if stage == 1 else (self.stage2_space or self.space)
        if space is not None:
            return sample_step(rng, self.decode.max_kv_tokens, space)
        choices = self.prefill_choices if prefill_choices is None else prefill_choices
        contexts, prefill = sample_decode(rng, self.decode.max_kv_tokens, choices)
        return contexts, [(0, prefill)] if prefill else []

    def stage1_sample(
        self,
        rng: random.Random,
        prefill_choices: tuple[int, ...] | None = None,
        decode_sms: int | None = None,
        stage: int = 1,
    ) -> tuple[Any, ...]:
        """Capture and time one random decode configuration alone (on ``decode_sms`` SMs, or
        a random partition); returns what stage 2 needs. ``stage`` 2: drawn from the stage-2
        space (a decode configuration that is then timed beside a quantum)."""
        if decode_sms is None:
            decode_sms = rng.choice(self.sharing.table.choices)
        contexts, chunks = self._draw(rng, stage, prefill_choices)
        prefill = sum(n for _, n in chunks)
        ds, fs = self.sharing.partition(decode_sms)
        self._log(
            f"capture sms={decode_sms} batch={len(contexts)} max={max(contexts)} chunks={chunks}"
        )
        if self.source == "engine":
            graph = self.decode.capture(contexts, prefill, ds, partition=decode_sms, chunks=chunks)
        else:
            graph = self.decode.capture(contexts, prefill, ds, partition=decode_sms)
        if ds is not None:
            ds.wait_stream(torch.cuda.current_stream(self.device))  # staged inputs first
        times = time_graph(graph, ds, self.iters)
        self._log(f"decode alone {statistics.median(times):.3f} ms")
        self._row(1, decode_sms, contexts, prefill, times, chunks=chunks)
        return graph, decode_sms, contexts, prefill, statistics.median(times), chunks

    def stage2_sample(self, rng: random.Random) -> None:
        """One decode configuration beside a random LoRA quantum, forward then backward
        (peft mode), or several beside one trainer quantum (trainer mode)."""
        if self.finetune == "trainer":
            self.stage2_trainer_sample(rng)
            return
        graph, decode_sms, contexts, prefill, decode_ms, chunks = self.stage1_sample(
            rng, self.stage2_prefill_choices, stage=2
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
                row = self._row(
                    2, decode_sms, contexts, prefill, times, ft, (alone_ms, colocated), chunks
                )
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
                graph, _, contexts, prefill, decode_ms, chunks = self.stage1_sample(
                    rng, self.stage2_prefill_choices, decode_sms=decode_sms, stage=2
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
                row = self._row(
                    2, decode_sms, contexts, prefill, times, ft, (alone_ms, colocated), chunks
                )
                row["ft_busy_frac"] = busy
                del graph
        finally:
            self.quanta.release()
            torch.cuda.empty_cache()
