"""Our engine under ``bench/decode/run.py``: building it for a model's sweep, putting sequences into
it that already sit at a context (`inject`), timing its decode steps (`time_engine`), switching
its variant (`set_variant`) and the prefill-chunk study (`time_prefill_chunks`); also the copy
bandwidth the floor divides by."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from typing import Any

import torch

from bench.common.timing import event_times
from bench.decode.args import VARIANTS, Sweep
from gpu_runtime.engine import Engine, EngineConfig, Request, SamplingParams
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.step_types import StepTimes
from gpu_runtime.model import CausalLM

DEVICE = torch.device("cuda")
PREFILL_PROMPT = 2048  # tokens of the prompt the prefill-chunk study prefills


def copy_bandwidth(gigabytes: float = 4.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gigabytes * 1e9 / 2)
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = [ms / 1e3 for ms in event_times(functools.partial(dst.copy_, src), iters)]
    del src, dst
    return 2 * n * 2 / statistics.median(times)


def build_engine(
    model: CausalLM,
    args: argparse.Namespace,
    sweep: Sweep,
) -> Engine:
    """An engine for one model's sweep, sized for every (batch, context), the HF context and the
    prefill studies, with KV storage filled with random values (never zeros)."""
    batches, chunks = sweep.batches, sweep.chunks
    max_ctx = max(sweep.contexts + [args.hf_context] + ([PREFILL_PROMPT + 1] if chunks else []))
    extra = args.warmup + args.steps + 8
    # the prefill studies run 32 decode rows beside a new prompt
    seqs = max([*batches, *([64] if chunks or "mixed" in sweep.extras else [])])
    blocks = seqs * (-(-(max_ctx + extra) // 16)) + 16

    def random_storage(
        shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_()

    engine_config = EngineConfig(
        num_kv_blocks=blocks,
        block_size=16,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, max(batches), max(chunks, default=0) + 32),
        max_model_len=max_ctx + extra + 16,
        device="cuda",
        fused_decode_kernels=not args.no_fused,
        decode_blas_library=args.blas,
        mixed_cuda_graphs=args.mixed_graphs,
    )
    return Engine(model, engine_config, kv_storage_factory=random_storage)


def bucket_for(engine: Engine, batch: int) -> int:
    """The smallest decode graph bucket holding `batch` rows."""
    return next(b for b in engine.config.graph_batch_sizes() if b >= batch)


def inject(
    engine: Engine,
    batch: int,
    context: int,
    max_tokens: int,
    seed: int,
    lora_names: list[str | None] | None = None,
) -> list[str]:
    """Put `batch` running sequences into the scheduler whose first context-1 tokens are
    treated as cached (the KV storage holds random values): the next step is a decode step.
    `lora_names[i]`: row i's adapter, attached to the engine's LoRA runtime here (released by
    the scheduler when the request finishes or is aborted)."""
    scheduler = engine.scheduler
    assert isinstance(scheduler, ContinuousBatchingScheduler)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.8, ignore_eos=True, detokenize=False
    )
    ids = []
    for i in range(batch):
        rid = f"bench-{seed}-{i}"
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        request = Request(rid, prompt, params, lora_name=lora_names[i] if lora_names else None)
        engine.block_manager.append_slots(request.block_table, context)
        request.num_computed_tokens = context - 1
        scheduler.add_running_request(request)
        ids.append(rid)
    return ids


def replay_ms(engine: Engine, bucket: int, reps: int) -> list[float]:
    """Device ms of `reps` replays of the decode graph of `bucket` (CUDA events); none where the
    engine has no such graph."""
    runner = engine.runner
    graphs = runner.decode.graphs if runner.static_decode else None
    if graphs is None or not graphs.has(bucket):
        return []
    return event_times(lambda: graphs.replay(bucket), reps)


def time_engine(
    engine: Engine, batch: int, context: int, warmup: int, steps: int
) -> dict[str, Any]:
    """`steps` decode steps of `batch` sequences at `context` after `warmup` untimed ones: wall
    ms of each `Engine.step()`, its phases (`Engine.last_step_times`), and the graph replay
    alone as often."""
    ids = inject(engine, batch, context, warmup + steps + 2, seed=batch * 100000 + context)
    for _ in range(warmup):
        engine.step()
    step_ms = []
    phases: dict[str, list[float]] = {name: [] for name in StepTimes._fields}
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        assert len(outputs) == batch
        for name, seconds in zip(StepTimes._fields, engine.last_step_times, strict=True):
            phases[name].append(seconds * 1e3)
    bucket = bucket_for(engine, batch)
    graph_ms = replay_ms(engine, bucket, steps)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # reads back a step still in flight (async scheduling); drops runner state
    mean_len = context + warmup + steps / 2
    return {
        "step_ms": step_ms,
        "graph_ms": graph_ms,
        "mean_context": mean_len,
        "bucket": bucket,
        "phases": phases,
    }


def set_variant(engine: Engine, variant: str, buckets: list[int]) -> None:
    """Switch a built engine to a bench variant: the scheduling mode (a config field the engine
    reads per step) and the fused step's kernel choices, with the decode graphs captured again
    when those change (the mixed-step graphs are kept as they are)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    torch.cuda.synchronize()  # no graph of the old set may still run when it is dropped
    engine.config = dataclasses.replace(engine.config, async_scheduling=variant != "sync")
    runner = engine.runner
    fused = runner.fused
    pdl_rows = {"pdl-all": 1 << 30, "no-pdl": 0}.get(
        variant, engine.config.decode_programmatic_launch_rows
    )
    if fused is None or fused.programmatic_launch_rows == pdl_rows:
        return
    fused.programmatic_launch_rows = pdl_rows
    mixed, runner.general.mixed_graphs = runner.general.mixed_graphs, None
    runner.decode.drop_graphs()
    torch.cuda.empty_cache()
    try:
        runner.capture_cuda_graphs(batch_sizes=tuple(buckets))
    finally:
        runner.general.mixed_graphs = mixed


def recover(engine: Engine) -> None:
    """After a variant's timing failed: back to synchronous scheduling, nothing in flight,
    every request aborted, one step to drop their runner state."""
    engine.config = dataclasses.replace(engine.config, async_scheduling=False)
    engine.overlap.in_flight = None
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    engine.step()


def time_prefill_chunks(
    engine: Engine, chunks: list[int], decode_rows: int, context: int, prompt_len: int
) -> list[dict[str, Any]]:
    """A `prompt_len`-token prompt arriving beside `decode_rows` decoding sequences, prefilled
    in chunks of each size (the scheduler's token budget set to chunk + decode rows): the
    steps' wall times (each is a decode step for the running rows, so its time is their TPOT)
    and the time to the prompt's first token."""
    scheduler = engine.scheduler
    assert isinstance(scheduler, ContinuousBatchingScheduler)
    original = scheduler.config
    gen = torch.Generator().manual_seed(17)
    vocab = engine.model_config.vocab_size
    ids = inject(engine, decode_rows, context, 512, seed=4242)
    results = []
    modes = [False, True] if engine.config.mixed_cuda_graphs else [False]
    runs = [(graphs, chunk) for graphs in modes for chunk in [chunks[0], *chunks]]
    try:
        for rep, (graphs, chunk) in enumerate(runs):  # the first of each mode compiles
            engine.runner.general.use_mixed_graphs = graphs
            scheduler.config = dataclasses.replace(
                original, max_num_batched_tokens=chunk + decode_rows
            )
            prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
            rid = engine.add_request(prompt, params, request_id=f"prefill-{rep}-{chunk}")
            step_ms: list[float] = []
            start = time.perf_counter()
            done = False
            while not done:
                t0 = time.perf_counter()
                outputs = engine.step()
                step_ms.append((time.perf_counter() - t0) * 1e3)
                done = any(o.request_id == rid and o.finished for o in outputs)
            ttft_ms = (time.perf_counter() - start) * 1e3
            if rep % (len(chunks) + 1) == 0:
                continue
            results.append(
                {
                    "mixed_graphs": graphs,
                    "chunk": chunk,
                    "decode_rows": decode_rows,
                    "context": context,
                    "prompt_len": prompt_len,
                    "steps": len(step_ms),
                    "step_ms_max": round(max(step_ms), 3),
                    "step_ms_mean": round(statistics.mean(step_ms), 3),
                    "ttft_ms": round(ttft_ms, 3),
                    "prefill_tokens_per_s": round(prompt_len / ttft_ms * 1e3, 1),
                }
            )
            print("prefill", results[-1], flush=True)
    finally:
        scheduler.config = original
        engine.runner.general.use_mixed_graphs = True
        for rid in ids:
            engine.abort_request(rid)
    return results
