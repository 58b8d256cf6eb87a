"""Multi-LoRA decode cost in the engine: `Engine.step()` TPOT at batch 32 (context ~512) with
base-only rows, with every row on one of 8 adapters, and mixed (every other row an adapter),
CUDA graphs on, for LoRA on q/k/v/o and on all linear projections.

Per target set: a Llama-3-8B-shaped model (seeded random bf16 weights), a `MultiLoraRuntime`
with `adapters` slots of rank `rank` (adapters written in PEFT format with random A and B, one
distinct adapter per slot), and an engine whose KV storage holds random values. `batch`
sequences are injected with `context - 1` tokens treated as cached, so every step is a decode
step; TPOT is the wall time of `Engine.step()` (scheduling, staging, graph replay, sampling, the
host sync) and `graph_replay_ms` the graph alone (CUDA events). Adapter steps replay the LoRA
graph (the fused step plus one shrink GEMM and one expand kernel per adapted projection group).

Before timing, an adapter step's logits are checked against the engine's previous LoRA path
(the eager `runtime.forward` over the same buffers): base rows must be bit-identical to the base
step, adapter rows must differ from the eager LoRA logits by about as little as the base rows of
the two paths do (kernel rounding), much less than the adapters' own effect. That previous path
is also timed (`system` `harli_eager_lora`, forward only) for comparison.

Run: `PYTHONPATH=. python3 bench/multilora.py --out DIR` (about 60 s on an H200);
`--model tiny --device cpu` is a smoke run (no graphs, no fused kernels on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.decode import inject, percentile
from bench.decode_engine import event_times
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.finetune.checkpoint import ADAPTER_WEIGHTS
from gpu_runtime.finetune.hparams import LoraSpec
from gpu_runtime.finetune.lora import PEFT_KEY_PREFIX, lora_config
from gpu_runtime.finetune.lora_serving import MultiLoraRuntime
from gpu_runtime.model import CausalLM, ModelConfig, build_random_model
from gpu_runtime.model.tiny import tiny_config

TARGETS = {"qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"), "all": ("all-linear",)}
MIXES = ("base", "adapters", "mixed")
GB = 1e9


def write_adapter(directory: Path, config: ModelConfig, spec: LoraSpec, seed: int) -> None:
    """A PEFT adapter with random A (~ 1/sqrt(in)) and B (~ 0.02): a visible effect on logits."""
    from gpu_runtime.finetune.adapter_store import projection_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in spec.target_modules:
            fan_in, fan_out = shapes[module]
            parent = "self_attn" if module in TARGETS["qkvo"] else "mlp"
            key = f"{PEFT_KEY_PREFIX}model.layers.{layer}.{parent}.{module}"
            a = torch.randn(spec.rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, spec.rank, generator=gen) * 0.02
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    lora_config(spec).save_pretrained(str(directory))
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def random_storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    return torch.empty(shape, dtype=dtype, device=device).normal_()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    for extra in engine.scheduler.running[decode_rows:]:  # type: ignore[attr-defined]
        engine.abort_request(extra.request_id)
    result: dict[str, list[float]] = {}
    for system, mixed in (("harli_mixed_step", True), ("harli_mixed_step_old", False)):
        runner.mixed_attention = mixed
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
    runner.mixed_attention = True
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
    step over the same static buffers (see the module docstring). With shared GEMMs the base
    rows' GEMM may be tiled differently: close to the base step, not necessarily equal."""
    runner = engine.runner
    slots = runner._buf_ints[4, :bucket].clone()
    fused = runner.decode_forward_lora(bucket).float()
    base = runner.decode_forward(bucket).float()
    runtime.weights.set_token_slots(slots.cpu())
    eager = runner.decode_forward(bucket, runtime.forward).float()
    runtime.weights.set_token_slots(torch.full((bucket,), -1))
    eager_base = runner.decode_forward(bucket, runtime.forward).float()
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
    *,
    batch: int,
    context: int,
    adapters: int,
    rank: int,
    steps: int,
    warmup: int,
    device: torch.device,
    adapter_root: Path,
    profile: bool = False,
    mode: str = "shared+kernels",
    mixed_step_rows: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows for one target set: base, adapters, mixed (+ the previous eager path).
    `mode` (`MODES`): "shared": the slots' A rows sit below the fused weights (one GEMM per
    group for base output and shrink), "separate": a shrink GEMM of its own; "+kernels": the
    q|k|v and gate|up expand terms are added inside the RoPE / SwiGLU kernels."""
    share_gemms = mode.startswith("shared")
    spec = LoraSpec(rank=rank, alpha=2 * rank, dropout=0.0, target_modules=TARGETS[targets])
    # a small model's position limit caps the context (the rows report the one used)
    context = min(context, model.config.max_position_embeddings - warmup - 2 * steps - 48)
    names = [f"{targets}-{i}" for i in range(adapters)]
    for i, adapter_name in enumerate(names):
        if not (adapter_root / adapter_name).exists():
            write_adapter(adapter_root / adapter_name, model.config, spec, seed=i)
    per_seq = -(-(context + warmup + 2 * steps + 20) // 16)
    config = EngineConfig(
        num_kv_blocks=batch * per_seq * 2 + 16,
        block_size=16,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
        max_model_len=per_seq * 16 + 16,
        device=str(device),
        cuda_graph_batch_sizes=(batch,),
        static_decode_batches=True,  # on CPU too: the eager LoRA step runs over the buffers
        lora_expand_in_kernels=mode.endswith("+kernels"),
    )
    runtime = MultiLoraRuntime(
        model,
        max_tokens=config.max_num_batched_tokens,
        num_slots=adapters,
        max_rank=rank,
        target_modules=spec.target_modules,
        share_gemms=share_gemms,
    )
    for adapter_name in names:
        runtime.register(adapter_name, adapter_root / adapter_name)
    engine = Engine(model, config, kv_storage_factory=random_storage, lora=runtime)
    t0 = time.perf_counter()
    captured = engine.capture_cuda_graphs()
    capture_s = time.perf_counter() - t0
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
        if mix == "adapters" and runner.fused_lora_decode:
            check = check_against_eager(engine, runtime, batch, share_gemms)
            print(f"{targets}: check {check}", flush=True)
        lora_graph_steps = runner.num_lora_graph_steps
        step_ms = time_steps(engine, steps, batch, device)
        torch_sampler_ms: list[float] = []
        if mix == "base" and runner.sampler.fused:  # the same steps with the torch sampler
            runner.sampler.fused = False
            torch_sampler_ms = time_steps(engine, steps, batch, device)
            runner.sampler.fused = True
        mixed_steps: dict[str, list[float]] = {}
        if mix == "base" and mixed_step_rows:
            mixed_steps = time_mixed_steps(engine, batch - 1, context, device)
        graphs = runner._lora_graphs if mix != "base" else runner._graphs
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
            eager_ms = replay_ms(lambda: runner.decode_forward(batch, runtime.forward), 20)
        row: dict[str, Any] = {
            "system": "harli",
            "targets": "-" if mix == "base" else targets,
            "mix": mix,
            "adapter_rows": sum(n is not None for n in lora_names),
            "tpot_ms_p50": round(statistics.median(step_ms), 4),
            "tpot_ms_p99": round(percentile(step_ms, 99), 4),
            "graph_replay_ms_p50": round(statistics.median(graph_ms), 4) if graph_ms else None,
            "lora_graph_steps": runner.num_lora_graph_steps - lora_graph_steps,
            "fused_sampler": runner.sampler.fused,
            "raw_step_ms": [round(x, 4) for x in step_ms],
        }
        rows.append(row)
        for system, times in mixed_steps.items():
            rows.append(
                {
                    "system": system,
                    "targets": "-",
                    "mix": "base",
                    "adapter_rows": 0,
                    "tpot_ms_p50": round(statistics.median(times), 4),
                    "tpot_ms_p99": round(percentile(times, 99), 4),
                    "graph_replay_ms_p50": None,
                    "note": f"one step: {batch - 1} decode rows + a {context}-token prefill "
                    "chunk (new request); _old: per-sequence torch attention loop, unfused model",
                }
            )
        if torch_sampler_ms:
            rows.append(
                {
                    "system": "harli_torch_sampler",
                    "targets": "-",
                    "mix": mix,
                    "adapter_rows": 0,
                    "tpot_ms_p50": round(statistics.median(torch_sampler_ms), 4),
                    "tpot_ms_p99": round(percentile(torch_sampler_ms, 99), 4),
                    "graph_replay_ms_p50": row["graph_replay_ms_p50"],
                    "note": "base steps with the multi-kernel torch sampler (before f981f9c)",
                }
            )
        if eager_ms:
            rows.append(
                {
                    "system": "harli_eager_lora",
                    "targets": targets,
                    "mix": mix,
                    "adapter_rows": row["adapter_rows"],
                    "graph_replay_ms_p50": None,
                    "forward_ms_p50": round(statistics.median(eager_ms), 4),
                    "note": "previous path: eager runtime.forward over the same buffers, "
                    "forward only (no sampling/host work)",
                }
            )
        for rid in ids:
            engine.abort_request(rid)
        print(
            f"{targets:5s} {mix:9s} step p50 {row['tpot_ms_p50']:.3f} ms "
            f"graph {row['graph_replay_ms_p50']} ms "
            f"eager {eager_ms and statistics.median(eager_ms)}",
            flush=True,
        )
    base = rows[0]
    for row in rows:
        row.update(
            {
                "lora_targets": targets,
                "mode": mode,
                "batch": batch,
                "context": context,
                "adapters": adapters,
                "lora_rank": rank,
                "slot_mem_gb": round(runtime.weights.nbytes / GB, 4),
            }
        )
        if row["system"] == "harli":
            row["overhead_frac"] = round(row["tpot_ms_p50"] / base["tpot_ms_p50"] - 1, 4)
            if row["graph_replay_ms_p50"] and base["graph_replay_ms_p50"]:
                ratio = row["graph_replay_ms_p50"] / base["graph_replay_ms_p50"]
                row["graph_overhead_frac"] = round(ratio - 1, 4)
    assert runtime._attached == {}
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    check["kernel_profiles"] = profiles
    check["captured"] = captured
    check["capture_s"] = round(capture_s, 2)
    return rows, check


MODES = ("shared+kernels", "shared", "separate")
"""LoRA decode variants: shrink in the base GEMM or apart; expand in RoPE/SwiGLU or apart."""


def check_key(targets: str, mode: str) -> str:
    return targets if mode == MODES[0] else f"{targets}/{mode}"


def run_multilora(
    model: CausalLM,
    *,
    batch: int = 32,
    context: int = 512,
    adapters: int = 8,
    rank: int = 16,
    targets: tuple[str, ...] = ("qkvo", "all"),
    steps: int = 50,
    warmup: int = 5,
    modes: tuple[str, ...] = MODES[:1],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """All rows and the correctness checks per target set and mode (checks keyed `targets`
    for the default mode, `targets/mode` otherwise); what `bench/finetune.py` calls."""
    device = model.lm_head.weight.device
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in targets:
            for mode in modes:
                target_rows, checks[check_key(name, mode)] = run_targets(
                    model,
                    name,
                    batch=batch,
                    context=context,
                    adapters=adapters,
                    rank=rank,
                    steps=steps,
                    warmup=warmup,
                    device=device,
                    adapter_root=Path(tmp),
                    mode=mode,
                )
                rows.extend(target_rows)
    return rows, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="preset name or 'tiny'")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="qkvo,all")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="kernel times per step")
    parser.add_argument("--modes", default=",".join(MODES), help=f"subset of {MODES}")
    parser.add_argument(
        "--mixed-steps", action="store_true", help="also time decode+prefill-chunk steps once"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    if args.model == "tiny":
        config = tiny_config("llama")
        dtype = "float32" if device.type == "cpu" else "bfloat16"
    else:
        config = ModelConfig.preset(args.model)
        dtype = "bfloat16"
    model = build_random_model(config, seed=0, device=device, dtype=dtype)
    targets = tuple(t for t in args.targets.split(",") if t)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    tag = "h200" if "H200" in gpu else gpu.split()[-1].lower()
    out = Path(args.out) / f"multilora-{tag}-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        modes = [m for m in args.modes.split(",") if m]
        for mode, name in [(m, t) for m in modes for t in targets]:  # file rewritten per set
            try:
                target_rows, checks[check_key(name, mode)] = run_targets(
                    model,
                    name,
                    batch=args.batch,
                    context=args.context,
                    adapters=args.adapters,
                    rank=args.rank,
                    steps=args.steps,
                    warmup=args.warmup,
                    device=device,
                    adapter_root=Path(tmp),
                    profile=args.profile,
                    mode=mode,
                    mixed_step_rows=args.mixed_steps and not rows,
                )
            except Exception as exc:  # keep the other sets' rows; say what broke
                import traceback

                traceback.print_exc()
                checks[check_key(name, mode)] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                target_rows = []
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.extend({"model": args.model} | r for r in target_rows)
            result = {
                "name": "multilora",
                "commit": args.commit,
                "gpu": gpu,
                "torch": torch.__version__,
                "created": datetime.datetime.now(datetime.UTC).isoformat(),
                "config": vars(args) | {"dtype": dtype, "block_size": 16, "sampling": "t=0.8"},
                "checks": checks,
                "rows": rows,
                "wall_s": round(time.perf_counter() - started, 1),
            }
            out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out} in {time.perf_counter() - started:.1f} s")
    print(
        f"{'system':17s} {'targets':7s} {'mode':14s} {'mix':9s} {'p50 ms':>8s} {'graph ms':>9s} "
        f"{'overhead':>9s} {'graph ovh':>9s}"
    )
    for r in rows:
        graph = r.get("graph_replay_ms_p50") or r.get("forward_ms_p50") or 0.0
        print(
            f"{r['system']:17s} {r['targets']:7s} {r['mode']:14s} {r['mix']:9s} "
            f"{r.get('tpot_ms_p50', 0):8.3f} {graph:9.3f} {r.get('overhead_frac', 0):+9.3f} "
            f"{r.get('graph_overhead_frac') or 0:+9.3f}"
        )
    for name, check in checks.items():
        print(f"check {name}: {check}")


if __name__ == "__main__":
    main()
