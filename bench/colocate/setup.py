"""Setup of ``bench/colocate/run.py``: the model, the engine with CUDA graphs per decode split, the
LoRA job, the output check, solo finetune speed and the layer-sliced profile (`setup_engine`);
or a `SimulatedHost` fitted to a GPU profile (`setup_simulation`)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from bench.colocate.backends import Backend, LoopBackend, SimBackend
from bench.colocate.simulator import PrefillCost, SimulatedHost, fit_truth_from_profile
from bench.common.examples import synthetic_examples
from bench.common.timing import sync
from gpu_runtime.agent.host_factory import ServingEngine, build_host_loop, build_serving_engine
from gpu_runtime.colocation import (
    CoLocationPolicy,
    DecodeOnlyPolicy,
    LaunchMode,
    NaivePolicy,
    StaticSplitPolicy,
)
from gpu_runtime.colocation.loop import LAUNCH_DURING_DECODE
from gpu_runtime.colocation.types import JobView
from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.engine import EngineConfig, SamplingParams
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import ModelConfig, build_random_model


def solo_finetune(
    trainer: LoraTrainer, tokens: int, seconds: float, device: torch.device
) -> tuple[float, float]:
    """(tokens/s, median ms per quantum) of ``tokens``-token quanta back to back, alone."""
    for _ in range(2):
        trainer.step_quantum(max_tokens=tokens)
    sync(device)
    done = 0
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        done += trainer.step_quantum(max_tokens=tokens).tokens
        times.append((time.perf_counter() - t0) * 1e3)
    return done / (time.perf_counter() - start), statistics.median(times)


def profile_slices(trainer: LoraTrainer, seq_len: int, device: torch.device) -> dict[str, Any]:
    """Layer-sliced quanta alone: per ``max_layers`` k and examples e, one micro-batch in calls of
    k passes; median ms of forward calls, backward calls, the last forward call (LM head and
    loss ride with it) and the completing call (micro-batch end: accumulate, host sync)."""
    out: dict[str, Any] = {}
    for examples, k in ((1, 1), (1, 4), (1, 16), (4, 4)):
        sync(device)
        calls: list[tuple[int, float]] = []
        t_start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            result = trainer.step_quantum(max_tokens=examples * seq_len, max_layers=k)
            calls.append((result.layer_passes, (time.perf_counter() - t0) * 1e3))
            if result.micro_batch_done:
                break
            if len(calls) > 4096:
                raise RuntimeError("sliced micro-batch did not complete")
        total_ms = (time.perf_counter() - t_start) * 1e3
        passes = sum(c[0] for c in calls)
        half = passes // 2
        fwd: list[tuple[int, float]] = []
        bwd: list[tuple[int, float]] = []
        seen = 0
        for i, (n, ms) in enumerate(calls):
            (fwd if seen < half else bwd).append((i, ms))
            seen += n
        out[f"e{examples}_k{k}"] = {
            "calls": len(calls),
            "layer_passes": passes,
            "micro_batch_ms": round(total_ms, 2),
            "forward_call_ms_median": round(statistics.median(m for _, m in fwd[:-1]), 3)
            if len(fwd) > 1
            else None,
            "last_forward_call_ms": round(fwd[-1][1], 3) if fwd else None,
            "backward_call_ms_median": round(statistics.median(m for _, m in bwd[:-1]), 3)
            if len(bwd) > 1
            else None,
            "completing_call_ms": round(calls[-1][1], 3),
        }
    return out


def slice_costs(profile: dict[str, Any]) -> tuple[float, float, float] | None:
    """(ms per call, per forward layer, per backward layer) from `profile_slices`' 1- and
    16-layer runs of one example; None when the profile lacks them."""
    one, wide = profile.get("e1_k1") or {}, profile.get("e1_k16") or {}
    keys = ("forward_call_ms_median", "backward_call_ms_median")
    if any(one.get(k) is None or wide.get(k) is None for k in keys):
        return None
    forward = max((wide[keys[0]] - one[keys[0]]) / 15, 0.0)
    backward = max((wide[keys[1]] - one[keys[1]]) / 15, 0.0)
    call = max(one[keys[0]] - forward, one[keys[1]] - backward, 0.0)
    return round(call, 3), round(forward, 3), round(backward, 3)


def check_outputs(serving: ServingEngine, trainer: LoraTrainer, vocab: int) -> dict:
    """Greedy tokens alone on the whole device vs on the smallest split beside a quantum."""
    engine, sharing = serving.engine, serving.sharing
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (9, 120, 300, 33)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    results = []
    beside: CoLocationPolicy = (
        NaivePolicy(1) if sharing is None else StaticSplitPolicy(sharing.table.choices[0], 1)
    )
    for policy in (DecodeOnlyPolicy(), beside):
        loop = build_host_loop(serving, policy, tpot_slo_ms=1e9)
        loop.add_job("check", trainer)
        ids = [
            loop.add_request(p, params, f"check-{policy.name}-{i}") for i, p in enumerate(prompts)
        ]
        tokens: dict[str, list[int]] = {}

        def keep(outs: list[Any], into: dict[str, list[int]] = tokens) -> None:
            into.update({o.request_id: o.output_token_ids for o in outs})

        loop.output_sink = keep
        while engine.has_unfinished_requests():
            loop.run_iteration()
        loop.close()
        results.append([tokens[i] for i in ids])
    agree = sum(a == b for x, y in zip(*results, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in results[0])
    return {"greedy_token_agreement": agree / total, "tokens": total}


def setup_engine(
    args: argparse.Namespace, device: torch.device, rank: int
) -> tuple[Backend, dict[str, Any]]:
    """Model, engine with graphs per split, LoRA trainer, output check, solo finetune speed."""
    config = ModelConfig.preset(args.model)
    if config.max_position_embeddings < 2048:  # the tiny preset: room for the traces' lengths
        config = config.replace(max_position_embeddings=2048)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model = build_random_model(config, seed=args.seed, device=device, dtype=dtype)
    vocab = config.vocab_size
    buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    engine_config = EngineConfig(
        num_kv_blocks=4096 if device.type == "cuda" else 512,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=2048,
        device=str(device),
        cuda_graph_batch_sizes=buckets,
        mixed_cuda_graphs=args.mixed_graphs,
        partition_gemm_sm_target=args.partition_gemm_sm_target,
        decode_programmatic_launch_rows=args.decode_programmatic_launch_rows,
        async_scheduling=args.async_scheduling,
    )
    groups = tuple(int(g) for g in args.decode_groups.split(",") if g)
    t0 = time.perf_counter()
    serving = build_serving_engine(model, engine_config, memory_pool=False, decode_groups=groups)
    sync(device)
    build_s = time.perf_counter() - t0
    sharing = serving.sharing
    hparams = resolve_hyperparameters(
        n_train_examples=2048,
        n_epochs=50,
        batch_size=8,
        lora=LoraSpec(rank=rank, alpha=32, dropout=getattr(args, "ft_dropout", 0.05)),
        seed=args.seed,
        warmup_ratio=0.0,
        max_seq_len=args.ft_seq_len,
    )
    examples = synthetic_examples(2048, args.ft_seq_len, vocab, args.seed + 1)

    def make_trainer(cuda_graphs: bool | None) -> LoraTrainer:
        return LoraTrainer(model, examples, hparams, cuda_graphs=cuda_graphs, max_cuda_graphs=48)

    trainer = make_trainer(None)
    check = check_outputs(serving, trainer, vocab)
    one_tps, one_ms = solo_finetune(trainer, args.ft_seq_len, 1.0, device)
    solo_tps, eight_ms = solo_finetune(trainer, 8 * args.ft_seq_len, 2.0, device)
    overhead_ms = max(0.0, (8 * one_ms - eight_ms) / 7)
    try:
        slices: dict[str, Any] = profile_slices(trainer, args.ft_seq_len, device)
    except Exception as exc:  # the trainer is being reworked; report, do not stop the run
        slices = {"error": f"{type(exc).__name__}: {exc}"}
    solo = {
        "tokens_per_s_8_examples": solo_tps,
        "ms_8_examples": eight_ms,
        "tokens_per_s_1_example": one_tps,
        "ms_1_example": one_ms,
        "quantum_overhead_ms": overhead_ms,
        "layer_sliced": slices,
    }
    print(f"setup: engine {build_s:.1f}s solo {solo} check {check}", flush=True)
    info = {
        "backend": "gpu_runtime.colocation.HostLoop on the decode engine, both built as the "
        "host agent builds them (gpu_runtime.agent.host_factory)",
        "solo_finetune": solo,
        "check": check,
        "engine_build_s": build_s,  # the engine, its sharing and its decode graphs per split
        "sharing": None
        if sharing is None
        else {"mechanism": sharing.mechanism, "choices": list(sharing.table.choices)},
        "launch_during_decode": args.launch_during_decode,
        "engine": {
            "max_num_seqs": engine_config.max_num_seqs,
            "max_num_batched_tokens": engine_config.max_num_batched_tokens,
            "buckets": buckets,
            "block_size": engine_config.block_size,
            "num_kv_blocks": engine_config.num_kv_blocks,
            "mixed_cuda_graphs": engine_config.mixed_cuda_graphs,
            "chunk_attention": engine_config.chunk_attention,
            "partition_gemm_sm_target": engine_config.partition_gemm_sm_target,
            "decode_programmatic_launch_rows": engine_config.decode_programmatic_launch_rows,
            "async_scheduling": engine_config.async_scheduling,
            "mixed_graph_token_sizes": (
                engine_config.mixed_graph_token_sizes() if engine_config.mixed_cuda_graphs else None
            ),
        },
    }
    backend = LoopBackend(serving, trainer, vocab, solo_tps)
    backend.make_trainer = make_trainer
    backend.launch_during_decode = args.launch_during_decode
    return backend, info


def setup_simulation(args: argparse.Namespace, rank: int) -> tuple[Backend, dict[str, Any]]:
    """`SimulatedHost` whose latencies are fitted to a profiler CSV measured on a GPU."""
    truth, costs = fit_truth_from_profile(args.simulate)
    fixed = float(getattr(args, "sim_prefill_fixed_ms", 0.0))
    launch = float(getattr(args, "sim_launch_host_ms", 0.0))
    during = bool(getattr(args, "launch_during_decode", LAUNCH_DURING_DECODE))
    host = SimulatedHost(
        truth,
        costs,
        prefill=PrefillCost(fixed_ms=fixed),
        launch_host_ms=launch,
        launch_during_decode=during,
        seed=args.seed,
    )
    seq = args.ft_seq_len
    job = JobView("ft", seq, seq, rank, tokens_per_s_solo=None)
    eight = costs.duration_ms(8 * seq, 1.0, LaunchMode.AFTER_DECODE)
    one = costs.duration_ms(seq, 1.0, LaunchMode.AFTER_DECODE)
    solo = {
        "tokens_per_s_8_examples": 8 * seq / (eight / 1e3),
        "ms_8_examples": eight,
        "tokens_per_s_1_example": seq / (one / 1e3),
        "ms_1_example": one,
        "quantum_overhead_ms": costs.overhead_ms,
    }
    job = JobView("ft", seq, seq, rank, tokens_per_s_solo=solo["tokens_per_s_8_examples"])
    info = {
        "backend": "SIMULATION: bench.colocate.simulator.SimulatedHost; decode and "
        "quantum latencies modelled from the profile below (measured on a GPU), prefill cost "
        f"modelled ({fixed} ms per step with a chunk, plus 0.025 ms/token on the whole "
        "device, inverse to the SM share), lognormal "
        f"noise sigma 0.05, 0.4 ms host overhead per iteration, {launch} ms host time per "
        f"quantum launch ({'beside' if during else 'before'} the decode step). Not a GPU "
        "measurement.",
        "launch_during_decode": during,
        "sim_launch_host_ms": launch,
        "profile": args.simulate,
        "quantum_cost_model": asdict(costs),
        "solo_finetune": solo,
        "sharing": {"mechanism": "simulated", "choices": list(host.decode_sms_options)},
    }
    return SimBackend(host, job), info
