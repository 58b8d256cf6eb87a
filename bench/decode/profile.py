"""Where a decode step's device time goes: kernel-time breakdown per step (torch profiler over
the eager graph body) and a paged-attention tile sweep, Llama-3-8B shape on one GPU.

Run through `python -m bench.decode --profile`; writes
`decode-profile-<gpu>-<yyyymmdd>.json`. The studies of `--extras` are in `bench/decode/extras.py`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.common.timing import event_times
from bench.decode.engine import (
    DEVICE,
    bucket_for,
    copy_bandwidth,
    inject,
    replay_ms,
)
from bench.decode.report import floor_ms
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model import ModelConfig, build_random_model

_KERNEL_GROUPS = (
    ("attention", "_paged_decode"),
    ("attention_merge", "_merge_splits"),
    ("rmsnorm", "_rms_norm"),
    ("rope_cache_write", "_rope_cache"),
    ("silu_mul", "_silu_mul"),
    ("embedding", "embedding"),
)


def _kernel_group(name: str) -> str:
    for group, key in _KERNEL_GROUPS:
        if key in name:
            return group
    lowered = name.lower()
    if any(k in lowered for k in ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "splitk")):
        return "gemm"
    return "other"


@torch.no_grad()
def profile_step(engine: Engine, batch: int, context: int, reps: int = 3) -> dict[str, Any]:
    """Device time per kernel group of one decode step (eager replay of the graph body, same
    kernels) and the graph replay time, to show where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    ids = inject(engine, batch, context, 16, seed=7 + batch + context)
    for _ in range(3):
        engine.step()
    runner = engine.runner
    bucket = bucket_for(engine, batch)
    runner.decode.decode_forward(bucket)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner.decode.decode_forward(bucket)
        torch.cuda.synchronize()
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        raw: Any = getattr(event, "self_device_time_total", None)
        if raw is None:
            raw = getattr(event, "self_cuda_time_total", 0.0)
        micros = float(raw)
        group = _kernel_group(event.key)
        groups[group] = groups.get(group, 0.0) + float(micros) / 1e3 / reps
    graph_ms = replay_ms(engine, bucket, 10)
    for rid in ids:
        engine.abort_request(rid)
    return {
        "batch": batch,
        "context": context,
        "kernel_ms": {k: round(v, 4) for k, v in sorted(groups.items())},
        "kernel_ms_total": round(sum(groups.values()), 4),
        "graph_replay_ms_p50": round(statistics.median(graph_ms), 4) if graph_ms else None,
    }


@torch.no_grad()
def sweep_attention(bandwidth: float) -> list[dict[str, Any]]:
    """Paged-decode kernel alone, Llama-3-8B head layout, over tile/warp/stage choices."""
    from gpu_runtime.engine.attention.triton_decode import (
        choose_num_splits,
        paged_decode_attention,
    )

    results = []
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    for batch, context in ((8, 2048), (64, 2048), (256, 2048), (256, 512)):
        per_seq = -(-context // bs)
        blocks = batch * per_seq
        cache = torch.randn(blocks + 1, 2, kv_heads, bs, dim, device=DEVICE, dtype=torch.bfloat16)
        table = torch.randperm(blocks, device=DEVICE).view(batch, per_seq).int()
        lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
        q = torch.randn(batch, heads, dim, device=DEVICE, dtype=torch.bfloat16)
        kv_bytes = batch * context * kv_heads * dim * 2 * 2
        base_splits = choose_num_splits(batch, kv_heads)
        for block_n, warps, stages, splits in (
            (64, 4, 2, base_splits),
            (32, 4, 2, base_splits),
            (128, 4, 2, base_splits),
            (64, 8, 2, base_splits),
            (64, 4, 3, base_splits),
            (128, 8, 3, base_splits),
            (64, 4, 2, base_splits * 2),
        ):
            key_cache, value_cache = cache[:, 0], cache[:, 1]
            run = functools.partial(
                paged_decode_attention,
                *(q, key_cache, value_cache, table, lens, bs, splits),
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
            )
            times = event_times(run, 23)[3:]  # the first 3 warm up
            ms = statistics.median(times)
            results.append(
                {
                    "batch": batch,
                    "context": context,
                    "block_n": block_n,
                    "num_warps": warps,
                    "num_stages": stages,
                    "num_splits": splits,
                    "ms": round(ms, 4),
                    "bandwidth_frac": round(kv_bytes / bandwidth * 1e3 / ms, 4),
                }
            )
            print(results[-1], flush=True)
        del cache
    return results


def run_profile(args: argparse.Namespace) -> None:
    """--profile: where a decode step's device time goes (Llama-3-8B), and an attention sweep."""
    bandwidth = copy_bandwidth()
    config = ModelConfig.preset("llama3-8b")
    model = build_random_model(config, seed=0, device=DEVICE, dtype="bfloat16")
    engine = Engine(
        model,
        EngineConfig(
            num_kv_blocks=256 * 130 + 16,
            block_size=16,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=2100,
            device="cuda",
        ),
        kv_storage_factory=lambda shape, dtype, device: torch.empty(
            shape, dtype=dtype, device=device
        ).normal_(),
    )
    engine.capture_cuda_graphs(batch_sizes=(1, 8, 64, 256))
    steps = [
        profile_step(engine, b, c)
        for b, c in ((1, 512), (8, 512), (64, 512), (256, 512), (256, 2048))
    ]
    for row in steps:
        row["floor_ms"] = round(floor_ms(config, row["batch"], row["context"], bandwidth), 4)
        flops = (
            2 * (config.num_parameters() - config.vocab_size * config.hidden_size) * row["batch"]
        )
        row["gemm_tflop"] = round(flops / 1e12, 3)
        print(row, flush=True)
    del engine, model
    torch.cuda.empty_cache()
    sweep = sweep_attention(bandwidth)
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    out = Path(args.out) / f"decode-profile-h200-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "name": "decode-profile",
                "commit": args.commit,
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "created": datetime.datetime.now(datetime.UTC).isoformat(),
                "copy_bandwidth_tb_s": round(bandwidth / 1e12, 4),
                "config": {
                    "model": "llama3-8b",
                    "profiled": "eager decode_forward, 3 reps, per step",
                    "sweep": "paged decode kernel alone, one layer, Llama-3-8B heads",
                },
                "steps": steps,
                "attention_sweep": sweep,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    print(f"{'batch':>5s} {'ctx':>5s} {'floor':>7s} {'graph':>7s} {'kernels':>8s}  groups (ms)")
    for row in steps:
        print(
            f"{row['batch']:5d} {row['context']:5d} {row['floor_ms']:7.3f} "
            f"{row['graph_replay_ms_p50']:7.3f} {row['kernel_ms_total']:8.3f}  {row['kernel_ms']}"
        )
