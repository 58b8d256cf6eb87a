"""What ``bench/structured/run.py`` times: decode steps of a batch with some rows constrained by a
JSON schema (`time_decode`), the grammar's compile (`compile_costs`), and the two per-step
costs of a constrained step apart (`mask_costs`: the host's bitmask fill, the device's
masking)."""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import time
from typing import Any

import torch

from bench.common.samples import sample_percentile
from bench.common.timing import event_times, sync
from gpu_runtime.engine import Engine, EngineConfig, Request, SamplingParams
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.step_types import StepTimes
from gpu_runtime.model import CausalLM
from gpu_runtime.structured import StructuredOutputParams
from gpu_runtime.structured.bitmask import TokenBitmask
from gpu_runtime.structured.compiler import StructuredCompiler

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    },
    "required": ["notes"],
    "additionalProperties": False,
}
"""At least 64 strings: a constrained row cannot end (and leave the batch) within the timed
steps, whatever random weights sample."""


def build_engine(
    model: CausalLM, tokenizer: Any, batch: int, context: int, max_tokens: int
) -> Engine:
    """An engine for `batch` rows at `context` (async scheduling, as the server runs it), KV
    storage filled with random values, decode graphs captured on CUDA for the bucket."""
    device = model.lm_head.weight.device

    def random_storage(
        shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_()

    block_size = 16
    config = EngineConfig(
        num_kv_blocks=batch * (-(-(context + max_tokens + 16) // block_size)) + 16,
        block_size=block_size,
        max_num_seqs=batch,
        max_num_batched_tokens=max(256, batch),
        max_model_len=context + max_tokens + 16,
        device=str(device),
        static_decode_batches=True,
        cuda_graph_batch_sizes=(batch,),
        async_scheduling=True,
    )
    engine = Engine(model, config, tokenizer=tokenizer, kv_storage_factory=random_storage)
    if device.type == "cuda":
        engine.capture_cuda_graphs(batch_sizes=(batch,))
    return engine


def inject(
    engine: Engine,
    batch: int,
    context: int,
    max_tokens: int,
    seed: int,
    constrained: int,
    structured: StructuredOutputParams,
) -> list[str]:
    """`batch` running sequences whose first `context - 1` tokens are treated as cached (the KV
    storage holds random values), the first `constrained` of them with `structured` (their
    matchers admitted as `Engine.add_request` does): the next step is a decode step."""
    scheduler = engine.scheduler
    assert isinstance(scheduler, ContinuousBatchingScheduler)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    free = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True, detokenize=False)
    bound = SamplingParams(
        max_tokens=max_tokens, temperature=0.8, detokenize=False, structured_output=structured
    )
    ids = []
    for i in range(batch):
        rid = f"bench-{seed}-{i}"
        params = bound if i < constrained else free
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        request = Request(rid, prompt, params)
        if params.structured_output is not None:
            engine.structured.admit(rid, params.structured_output)
        engine.block_manager.append_slots(request.block_table, context)
        request.num_computed_tokens = context - 1
        scheduler.add_running_request(request)
        ids.append(rid)
    return ids


def time_decode(
    engine: Engine,
    *,
    batch: int,
    context: int,
    constrained: int,
    structured: StructuredOutputParams,
    warmup: int,
    steps: int,
    async_scheduling: bool,
) -> dict[str, Any]:
    """`steps` timed decode steps (wall ms of each `Engine.step()`, its phases) after `warmup`
    untimed ones, every row decoding throughout; the constrained rows' tokens are checked
    against a fresh matcher of the grammar after (every token accepted)."""
    engine.config = dataclasses.replace(engine.config, async_scheduling=async_scheduling)
    runner = engine.runner
    ids = inject(
        engine, batch, context, warmup + steps + 4, 7 + constrained, constrained, structured
    )
    for _ in range(warmup):
        engine.step()
    overlapped, deferred = runner.num_overlapped_steps, runner.num_deferred_samplings
    masked = engine.structured.num_constrained_steps
    step_ms: list[float] = []
    phases: dict[str, list[float]] = {name: [] for name in StepTimes._fields}
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        if len(outputs) != batch or any(o.finished for o in outputs):
            raise RuntimeError(f"a row left the batch: {[o.finish_reason for o in outputs]}")
        for name, seconds in zip(StepTimes._fields, engine.last_step_times, strict=True):
            phases[name].append(seconds * 1e3)
    sync(engine.runner.device)
    requests = engine.scheduler.requests
    accepted = all(
        _replays(engine, structured, requests[rid].output_token_ids) for rid in ids[:constrained]
    )
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # reads back a step in flight; drops the runner's state
    return {
        "tpot_ms_p50": round(statistics.median(step_ms), 4),
        "tpot_ms_p99": round(sample_percentile(step_ms, 99), 4),
        "raw_step_ms": [round(t, 4) for t in step_ms],
        "phases_ms_p50": {k: round(statistics.median(v), 4) for k, v in phases.items()},
        "overlapped_steps": runner.num_overlapped_steps - overlapped,
        "deferred_samplings": runner.num_deferred_samplings - deferred,
        "masked_steps": engine.structured.num_constrained_steps - masked,
        "grammar_accepts_every_token": accepted,
    }


def _replays(engine: Engine, structured: StructuredOutputParams, tokens: list[int]) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(engine.structured.compiler.compile(structured))
    return all(matcher.accept_token(t) for t in tokens)


def compile_costs(tokenizer: Any, vocab_size: int, structured: StructuredOutputParams) -> dict:
    """Seconds to read the tokenizer's vocabulary (once per engine) and to compile the schema
    cold, then from the cache."""
    started = time.perf_counter()
    compiler = StructuredCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    compiler.compile(StructuredOutputParams("regex", "a"))  # builds the vocabulary tables
    vocabulary_s = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(structured)
    cold_s = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(structured)
    cached_s = time.perf_counter() - started
    return {
        "vocabulary_s": round(vocabulary_s, 4),
        "compile_ms": round(cold_s * 1e3, 3),
        "cached_ms": round(cached_s * 1e3, 4),
    }


def mask_costs(
    engine: Engine, structured: StructuredOutputParams, rows: int, batch: int, steps: int
) -> dict[str, Any]:
    """The two costs of a constrained step apart, over `steps` steps of `rows` matchers advanced
    with seeded random allowed tokens: host ms of the batched bitmask fill, and ms of masking
    the rows of a `[batch, V]` logits tensor (CUDA events on CUDA, wall time on the CPU)."""
    import xgrammar as xgr

    grammar = engine.structured.compiler.compile(structured)
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
    vocab = engine.model_config.vocab_size
    device = engine.runner.device
    bitmask = TokenBitmask(rows, vocab, device)
    filler = xgr.BatchGrammarMatcher(max_threads=8)
    logits = torch.randn(batch, vocab, device=device, dtype=torch.bfloat16)
    picked_rows = list(range(rows))
    rng = random.Random(0)
    fill_ms, apply_ms = [], []
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(steps):
        host = bitmask.host_rows(rows)
        started = time.perf_counter()
        filler.batch_fill_next_token_bitmask(matchers, host)
        fill_ms.append((time.perf_counter() - started) * 1e3)
        if device.type == "cuda":
            apply_ms += event_times(functools.partial(bitmask.apply, logits, host, picked_rows), 1)
        else:
            started = time.perf_counter()
            bitmask.apply(logits, host, picked_rows)
            apply_ms.append((time.perf_counter() - started) * 1e3)
        for i, matcher in enumerate(matchers):
            allowed = ((host[i][:, None] >> shifts) & 1).bool().view(-1)[:vocab].nonzero()
            matcher.accept_token(int(allowed[rng.randrange(len(allowed))]))
    return {
        "rows": rows,
        "fill_ms_p50": round(statistics.median(fill_ms), 4),
        "fill_ms_p99": round(sample_percentile(fill_ms, 99), 4),
        "apply_ms_p50": round(statistics.median(apply_ms), 4),
        "apply_ms_p99": round(sample_percentile(apply_ms, 99), 4),
    }
