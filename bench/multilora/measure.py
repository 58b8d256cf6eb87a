"""Measurement of ``bench/multilora/run.py``: per target set (`run_targets`), each mix of rows
(`MIXES`: base only, every row on an adapter, every other row) injected as decode sequences,
warmed up, the adapter mix checked against the eager LoRA path (`check_against_eager`), then the
wall time of `Engine.step()` (`time_steps`), the graph replay alone (`replay_ms`), optionally the
kernels of a replay (`kernel_profile`), the torch sampler's steps, steps carrying a prefill
(`time_mixed_steps`) and the eager LoRA forward, one row per system (keys in
``report``)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.samples import sample_percentile
from bench.common.timing import event_times, sync
from bench.decode.engine import inject
from bench.multilora.report import (
    eager_lora_row,
    finish_rows,
    mixed_prefill_rows,
    torch_sampler_row,
)
from bench.multilora.setup import TARGETS, RunSizes, setup_targets
from gpu_runtime.engine import Engine
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM

MIXES = ("base", "adapters", "mixed")


def time_steps(engine: Engine, steps: int, batch: int, device: torch.device) -> list[float]:
    """Wall ms of `engine.step()` per step."""
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        assert len(outputs) == batch
    return times


def time_mixed_steps(
    engine: Engine, decode_rows: int, prompt_len: int, device: torch.device, iters: int = 5
) -> dict[str, list[float]]:
    """Wall ms of steps that prefill a new `prompt_len`-token request beside the running decode
    rows (first `decode_rows` are kept running; the new request stops after one token), with
    `MixedPagedAttention` + fused kernels and with the previous per-sequence path."""
    from gpu_runtime.engine import SamplingParams

    runner = engine.runner
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.8, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(7)
    for extra in engine.scheduler.running[decode_rows:]:
        engine.abort_request(extra.request_id)
    result: dict[str, list[float]] = {}
    for system, mixed in (("harli_mixed_step", True), ("harli_mixed_step_old", False)):
        runner.general.mixed_attention = mixed
        times = []
        for i in range(iters if mixed else 2):
            engine.add_request(
                torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params
            )
            sync(device)
            start = time.perf_counter()
            outputs = engine.step()
            times.append((time.perf_counter() - start) * 1e3)
            assert len(outputs) == decode_rows + 1, (system, i, len(outputs))
        result[system] = times
    runner.general.mixed_attention = True
    return result


@torch.no_grad()
def replay_ms(replay: Any, steps: int) -> list[float]:
    """Times of `replay()` in ms: CUDA events on CUDA, the host clock elsewhere."""
    if torch.cuda.is_available():
        return event_times(replay, steps)
    times = []
    for _ in range(steps):
        start_s = time.perf_counter()
        replay()
        times.append((time.perf_counter() - start_s) * 1e3)
    return times


def kernel_profile(replay: Any, iters: int = 10, top: int = 14) -> list[dict[str, Any]]:
    """Device time per step of the `top` kernels of `replay()` (torch.profiler, CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            rows.append(
                {
                    "kernel": event.key[:90],
                    "us_per_step": round(total / iters, 1),
                    "calls_per_step": event.count / iters,
                }
            )
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


@torch.no_grad()
def check_against_eager(
    engine: Engine, runtime: MultiLoraRuntime, bucket: int, share_gemms: bool
) -> dict[str, Any]:
    """The last step's adapter logits (fused LoRA step) vs the eager LoRA forward and the base
    step over the same static buffers (see bench/multilora/run.py's docstring). With shared GEMMs
    the base rows' GEMM may be tiled differently: close to the base step, not necessarily equal."""
    runner = engine.runner
    slots = runner.decode.buf_ints[4, :bucket].clone()
    fused = runner.decode.decode_forward_lora(bucket).float()
    base = runner.decode.decode_forward(bucket).float()
    runtime.weights.set_token_slots(slots.cpu())
    eager = runner.decode.decode_forward(bucket, runtime.forward).float()
    runtime.weights.set_token_slots(torch.full((bucket,), -1))
    eager_base = runner.decode.decode_forward(bucket, runtime.forward).float()
    rows = slots >= 0
    lora_effect = float((eager[rows] - eager_base[rows]).abs().mean())
    adapter_diff = float((fused[rows] - eager[rows]).abs().mean())
    base_diff = float((fused[~rows] - eager[~rows]).abs().mean()) if (~rows).any() else 0.0
    agree = float((fused[rows].argmax(-1) == eager[rows].argmax(-1)).float().mean())
    base_rows_diff = float((fused[~rows] - base[~rows]).abs().max()) if (~rows).any() else 0.0
    result = {
        "base_rows_bit_identical": bool(torch.equal(fused[~rows], base[~rows])),
        "base_rows_max_abs_diff_vs_base_step": base_rows_diff,
        "adapter_rows": int(rows.sum()),
        "lora_effect_mean_abs_logit": lora_effect,
        "fused_vs_eager_adapter_rows_mean_abs": adapter_diff,
        "fused_vs_eager_base_rows_mean_abs": base_diff,
        "fused_vs_eager_argmax_agreement": agree,
    }
    base_ok = result["base_rows_bit_identical"] or (share_gemms and base_rows_diff < 0.25)
    result["ok"] = bool(base_ok and adapter_diff < 0.25 * lora_effect)
    return result


def run_targets(
    model: CausalLM,
    targets: str,
    sizes: RunSizes,
    *,
    device: torch.device,
    adapter_root: Path,
    profile: bool = False,
    mode: str = "shared+kernels",
    mixed_step_rows: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows for one target set: base, adapters, mixed (+ the previous eager path), and the
    set's check. `mode`: see `setup_targets`."""
    setup = setup_targets(
        model, targets, sizes, device=device, adapter_root=adapter_root, mode=mode
    )
    engine, runtime, names = setup.engine, setup.runtime, setup.names
    context, share_gemms = setup.context, setup.share_gemms
    captured, capture_s = setup.captured, setup.capture_s
    batch, adapters, rank = sizes.batch, sizes.adapters, sizes.rank
    steps, warmup = sizes.steps, sizes.warmup
    del setup  # `del engine` below releases the engine
    runner = engine.runner
    rows: list[dict[str, Any]] = []
    check: dict[str, Any] = {"skipped": "no fused LoRA decode step on this device"}
    profiles: dict[str, Any] = {}
    for mix in MIXES:
        lora_names: list[str | None] = [
            None if mix == "base" or (mix == "mixed" and i % 2 == 0) else names[i % adapters]
            for i in range(batch)
        ]
        seed = 10 * sorted(TARGETS).index(targets) + MIXES.index(mix)
        max_tokens = warmup + 2 * steps + 12  # + the mixed steps
        ids = inject(engine, batch, context, max_tokens, seed, lora_names)
        for _ in range(warmup):
            engine.step()
        if mix == "adapters" and runner.decode.fused_lora_decode:
            check = check_against_eager(engine, runtime, batch, share_gemms)
            print(f"{targets}: check {check}", flush=True)
        lora_graph_steps = runner.decode.num_lora_graph_steps
        step_ms = time_steps(engine, steps, batch, device)
        torch_sampler_ms: list[float] = []
        if mix == "base" and runner.sampler.fused:  # the same steps with the torch sampler
            runner.sampler.fused = False
            torch_sampler_ms = time_steps(engine, steps, batch, device)
            runner.sampler.fused = True
        mixed_steps: dict[str, list[float]] = {}
        if mix == "base" and mixed_step_rows:
            mixed_steps = time_mixed_steps(engine, batch - 1, context, device)
        graphs = runner.decode.lora_graphs if mix != "base" else runner.decode.graphs
        graph_ms: list[float] = []
        if graphs is not None and graphs.has(batch):
            graph_ms = replay_ms(lambda g=graphs: g.replay(batch), steps)
            if profile and mix != "mixed":
                try:
                    profiles[f"profile_{mix}"] = kernel_profile(lambda g=graphs: g.replay(batch))
                except Exception as exc:  # the profile is extra information, not the result
                    profiles[f"profile_{mix}"] = f"{type(exc).__name__}: {exc}"[:300]
        eager_ms: list[float] = []
        if mix == "adapters":
            padded = [*[(rid, 1) for rid in ids], ("\x00padding", 0)]
            runtime.set_batch(padded)
            eager_ms = replay_ms(lambda: runner.decode.decode_forward(batch, runtime.forward), 20)
        row: dict[str, Any] = {
            "system": "harli",
            "targets": "-" if mix == "base" else targets,
            "mix": mix,
            "adapter_rows": sum(n is not None for n in lora_names),
            "tpot_ms_p50": round(statistics.median(step_ms), 4),
            "tpot_ms_p99": round(sample_percentile(step_ms, 99), 4),
            "graph_replay_ms_p50": round(statistics.median(graph_ms), 4) if graph_ms else None,
            "lora_graph_steps": runner.decode.num_lora_graph_steps - lora_graph_steps,
            "fused_sampler": runner.sampler.fused,
            "raw_step_ms": [round(x, 4) for x in step_ms],
        }
        rows.append(row)
        rows.extend(mixed_prefill_rows(mixed_steps, batch, context))
        if torch_sampler_ms:
            rows.append(torch_sampler_row(row, torch_sampler_ms))
        if eager_ms:
            rows.append(eager_lora_row(row, targets, eager_ms))
        for rid in ids:
            engine.abort_request(rid)
        print(
            f"{targets:5s} {mix:9s} step p50 {row['tpot_ms_p50']:.3f} ms "
            f"graph {row['graph_replay_ms_p50']} ms "
            f"eager {eager_ms and statistics.median(eager_ms)}",
            flush=True,
        )
    finish_rows(
        rows,
        {
            "lora_targets": targets,
            "mode": mode,
            "batch": batch,
            "context": context,
            "adapters": adapters,
            "lora_rank": rank,
        },
        runtime.weights.nbytes,
    )
    assert runtime._attached == {}
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    check["kernel_profiles"] = profiles
    check["captured"] = captured
    check["capture_s"] = round(capture_s, 2)
    return rows, check
