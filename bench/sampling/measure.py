"""What `bench.sampling` measures: the engine (Llama-3-8B shape on CUDA, the tiny model on CPU),
the two sampling mixes, steady decode batches put into it (`inject`), the timed steps, and the
checks run before timing."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bench.common.samples import sample_percentile
from gpu_runtime.engine import Engine, EngineConfig, Request, SamplingParams
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.logits_processing import LogitsPlan
from gpu_runtime.engine.sampler import SamplingBatch
from gpu_runtime.model import CausalLM

BIAS_ENTRIES = 10


def mixes(vocab: int) -> dict[str, SamplingParams]:
    """`plain`: temperature 0.8; `penalties`: the same with presence, frequency and repetition
    penalties and a logit bias of `BIAS_ENTRIES` entries (what every row of the second mix
    asks)."""
    plain = SamplingParams(max_tokens=1 << 20, temperature=0.8, ignore_eos=True, detokenize=False)
    bias = tuple((vocab // (i + 2), float(i - 5)) for i in range(BIAS_ENTRIES))
    penalties = SamplingParams(
        max_tokens=1 << 20,
        temperature=0.8,
        ignore_eos=True,
        detokenize=False,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias=bias,
    )
    return {"plain": plain, "penalties": penalties}


def build_engine(
    model: CausalLM, device: torch.device, batches: list[int], context: int, steps: int
) -> Engine:
    """An engine sized for the largest batch at `context` plus every step of the run, KV
    storage random (never zeros), decode graphs captured for `batches` on CUDA."""
    seqs = max(batches)
    max_len = context + steps + 64
    blocks = seqs * (-(-max_len // 16)) + 16

    def random_storage(
        shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_()

    config = EngineConfig(
        num_kv_blocks=blocks,
        block_size=16,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, seqs),
        max_model_len=max_len,
        device=device.type,
        static_decode_batches=True,
        cuda_graph_batch_sizes=tuple(sorted(set(batches))),
    )
    engine = Engine(model, config, kv_storage_factory=random_storage)
    if device.type == "cuda":
        engine.capture_cuda_graphs()
    return engine


def inject(
    engine: Engine, batch: int, context: int, params: SamplingParams, seed: int
) -> list[str]:
    """`batch` running sequences whose first context-1 tokens count as cached (random KV): the
    next step is a decode step of all of them."""
    scheduler = engine.scheduler
    assert isinstance(scheduler, ContinuousBatchingScheduler)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    ids = []
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        request = Request(f"sampling-{seed}-{i}", prompt, params)
        engine.block_manager.append_slots(request.block_table, context)
        request.num_computed_tokens = context - 1
        scheduler.add_running_request(request)
        ids.append(request.request_id)
    return ids


def time_steps(
    engine: Engine,
    batch: int,
    context: int,
    params: SamplingParams,
    warmup: int,
    steps: int,
    seed: int,
) -> list[float]:
    """Wall ms of `steps` `Engine.step()` calls of a steady decode batch, after `warmup`."""
    ids = inject(engine, batch, context, params, seed)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        assert len(outputs) == batch
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # drops the runner state (and reads back a step in flight)
    return times


def summary(times: list[float]) -> dict[str, float]:
    """Median and p99 of a run's step times."""
    return {
        "tpot_ms_p50": sample_percentile(times, 50),
        "tpot_ms_p99": sample_percentile(times, 99),
    }


def check_forced_token(engine: Engine, batch: int, context: int) -> dict[str, Any]:
    """Greedy rows with +100 on one token sample only that token, through the decode path
    (graphs on CUDA): the bias reaches the sampler after the graph."""
    vocab = engine.model_config.vocab_size
    token = vocab - 7
    params = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logit_bias=((token, 100.0),),
        frequency_penalty=0.1,
    )
    ids = set(inject(engine, batch, context, params, seed=99))
    seen: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in ids:
                seen += out.new_token_ids
    ok = seen == [token] * (4 * batch)
    return {"forced_token_ok": ok, "tokens_checked": len(seen)}


def check_processed_logits(engine: Engine, batch: int) -> dict[str, Any]:
    """The plan applied to random logits on the device (the penalties by the sampler's own
    path: the Triton pass on CUDA) against a float64 reference of vLLM's order (bias, then
    repetition, frequency, presence) on the same inputs."""
    device = engine.runner.device
    vocab = engine.model_config.vocab_size
    gen = torch.Generator(device=device).manual_seed(3)
    logits = torch.randn(batch, vocab, device=device, generator=gen) * 4
    params = [mixes(vocab)["penalties"]] * batch
    counts = torch.randint(0, 3, (batch, vocab), device=device, generator=gen, dtype=torch.int32)
    counts *= torch.rand(batch, vocab, device=device, generator=gen) < 0.01
    prompt = torch.rand(batch, vocab, device=device, generator=gen) < 0.005
    plan = LogitsPlan.build(params, [0] * batch, ())
    plan.stage(device)
    rows = torch.arange(batch, device=device)
    fused = engine.runner.sampler.fused
    got = plan.apply(logits, (counts, prompt, rows), fused=fused and device.type == "cuda")
    got = got.double()
    ref = logits.double()
    p = params[0]
    for token, bias in p.logit_bias:
        ref[:, token] += bias
    seen = prompt | (counts > 0)
    factor = torch.where(seen, p.repetition_penalty, 1.0).double()
    ref = torch.where(ref > 0, ref / factor, ref * factor)
    ref = ref - p.frequency_penalty * counts.double() - p.presence_penalty * (counts > 0).double()
    error = float((got - ref).abs().max())
    assert SamplingBatch(params, [0] * batch).needs_processing
    return {
        "processed_logits_max_abs_error": error,
        "processed_logits_ok": error < 1e-4 and math.isfinite(error),
    }
