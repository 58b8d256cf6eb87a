"""Decode speed on one GPU: our engine vs HF transformers (eager; static cache + torch.compile)
vs the HBM floor, for Llama-3-8B and Qwen2.5-7B shapes with random bf16 weights.

Per model: build seeded random weights; our engine with CUDA graphs captured per batch bucket;
for each (batch, context) inject `batch` sequences whose first `context - 1` tokens already sit
in the KV cache (filled with random values, never zeros), then time `Engine.step()` end to end
(scheduler, input preparation, graph replay, sampling, the one host sync) over many decode
steps; also the graph replay alone with CUDA events. HF runs on the same weight tensors. The
floor is (weight bytes read once + the batch's KV bytes) / device-to-device copy bandwidth
measured in the same run.

Run: `PYTHONPATH=. python3 bench/decode.py` (see --help; --quick for a smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.engine import Engine, EngineConfig, Request, RequestStatus, SamplingParams
from gpu_runtime.engine.engine import StepTimes
from gpu_runtime.engine.scheduler import ContinuousBatchingScheduler
from gpu_runtime.model import CausalLM, ModelConfig, build_random_model
from gpu_runtime.model.tiny import tiny_config

DEVICE = torch.device("cuda")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def copy_bandwidth(gigabytes: float = 4.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gigabytes * 1e9 / 2)
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n * 2 / statistics.median(times)


def weight_bytes_read(config: ModelConfig) -> int:
    """Bytes a decode step reads from weights: everything but the embedding table (only B rows
    of it are read), unless the table is also the LM head."""
    params = config.num_parameters()
    if not config.tie_word_embeddings:
        params -= config.vocab_size * config.hidden_size
    return params * 2


def hf_model(model: CausalLM) -> torch.nn.Module:
    """A HF model whose parameters are `model`'s tensors (no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model.config.to_hf_config())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    hf.load_state_dict(model.state_dict(), assign=True, strict=False)
    hf.tie_weights()
    rotary = hf.model.rotary_emb
    with torch.device(DEVICE):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    return hf.eval()


@torch.no_grad()
def check_correctness() -> dict[str, Any]:
    """Our CUDA-graph decode path vs HF bf16 on a small model: logprobs of our greedy tokens."""
    results: dict[str, Any] = {}
    for arch in ("llama", "qwen2"):
        config = tiny_config(
            arch,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=4096,
        ).replace(dtype="bfloat16")
        model = build_random_model(config, seed=1, device=DEVICE)
        engine = Engine(
            model,
            EngineConfig(
                num_kv_blocks=128,
                max_num_seqs=8,
                max_model_len=512,
                max_num_batched_tokens=1024,
                device="cuda",
            ),
        )
        engine.capture_cuda_graphs()
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (7, 100, 300)]
        params = SamplingParams(
            max_tokens=16, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True
        )
        ids = [engine.add_request(p, params) for p in prompts]
        toks: dict[str, list[int]] = {i: [] for i in ids}
        lps: dict[str, list[float]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                toks[out.request_id] += out.new_token_ids
                lps[out.request_id] += [lp.logprob for lp in out.new_logprobs]
        hf = hf_model(model)
        max_diff, agree, total = 0.0, 0, 0
        for rid, prompt in zip(ids, prompts, strict=True):
            ref = hf(torch.tensor([prompt + toks[rid]], device=DEVICE)).logits.float()
            ref = ref.log_softmax(-1)[0, len(prompt) - 1 : -1]
            chosen = torch.tensor(toks[rid], device=DEVICE)
            theirs = ref.gather(-1, chosen[:, None])[:, 0]
            max_diff = max(
                max_diff, float((torch.tensor(lps[rid], device=DEVICE) - theirs).abs().max())
            )
            agree += int((ref.argmax(-1) == chosen).sum())
            total += len(chosen)
        results[arch] = {"max_logprob_abs_diff": max_diff, "greedy_argmax_agreement": agree / total}
        del engine, model, hf
        torch.cuda.empty_cache()
    return results


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
        request.status = RequestStatus.RUNNING
        scheduler.requests[rid] = request
        if request.lora_name is not None:
            assert engine.lora is not None
            engine.lora.attach(rid, request.lora_name)
            scheduler._adapter_holders.add(rid)
        scheduler.running.append(request)
        ids.append(rid)
    return ids


def time_engine(
    engine: Engine, batch: int, context: int, warmup: int, steps: int
) -> dict[str, Any]:
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
    bucket = next(b for b in engine.runner._buckets if b >= batch)
    graph_ms = []
    graphs = engine.runner._graphs
    if graphs is not None and graphs.has(bucket):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(steps):
            s.record()
            graphs.replay(bucket)
            e.record()
            e.synchronize()
            graph_ms.append(s.elapsed_time(e))
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
    reads per step) and, for the skinny variants, the fused step's GEMM choice with the decode
    graphs captured again (the mixed-step graphs are kept as they are)."""
    if variant not in ("sync", "async", "skinny", "skinny-all"):
        raise ValueError(f"unknown variant {variant!r}")
    torch.cuda.synchronize()  # no graph of the old set may still run when it is dropped
    engine.config = dataclasses.replace(engine.config, async_scheduling=variant != "sync")
    runner = engine.runner
    fused = runner._fused
    rows = 64 if variant.startswith("skinny") else 0
    projections = frozenset(
        ("qkv", "o", "gate_up", "down") if variant == "skinny-all" else ("qkv", "o")
    )
    if fused is None or (fused.skinny_max_rows, fused.skinny_projections) == (rows, projections):
        return
    fused.skinny_max_rows, fused.skinny_projections = rows, projections
    mixed, runner._mixed = runner._mixed, None
    runner._graphs = runner._lora_graphs = None
    torch.cuda.empty_cache()
    try:
        runner.capture_cuda_graphs(batch_sizes=tuple(buckets))
    finally:
        runner._mixed = mixed


def time_prefill_chunks(
    engine: Engine, chunks: list[int], decode_rows: int, context: int, prompt_len: int
) -> list[dict[str, Any]]:
    """A `prompt_len`-token prompt arriving beside `decode_rows` decoding sequences, prefilled
    in chunks of each size (the scheduler's token budget set to chunk + decode rows): the
    steps' wall times (each is a decode step for the running rows, so its time is their TPOT)
    and the time to the prompt's first token."""
    import dataclasses

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
            engine.runner.use_mixed_graphs = graphs
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
        engine.runner.use_mixed_graphs = True
        for rid in ids:
            engine.abort_request(rid)
    return results


@torch.no_grad()
def time_hf(
    model: CausalLM, hf: torch.nn.Module, batch: int, context: int, steps: int, compiled: bool
) -> dict[str, Any]:
    from transformers import StaticCache

    gen = torch.Generator().manual_seed(batch + context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).to(DEVICE)
    warmup = 3 if compiled else 2
    if compiled:
        cache = StaticCache(config=hf.config, max_cache_len=context + warmup + steps + 1)  # type: ignore[arg-type]
        forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        out = hf(
            ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(context, device=DEVICE),
        )
    else:
        out = hf(ids, use_cache=True)
        cache = out.past_key_values
        forward = hf.forward
    token = out.logits[:, -1:].argmax(-1)
    del out
    times = []
    for step in range(warmup + steps):
        position = torch.tensor([context + step], device=DEVICE)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if compiled:
            logits = forward(
                token, past_key_values=cache, use_cache=True, cache_position=position
            ).logits
        else:
            logits = forward(token, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1).clone()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    del cache
    return {"step_ms": times, "mean_context": context + warmup + steps / 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama3-8b,qwen2.5-7b")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hf-eager", default="1,8,64", help="batches for HF eager (ctx 512)")
    parser.add_argument("--hf-compile", default="1,64", help="batches for HF compile (ctx 512)")
    parser.add_argument("--hf-compile-models", default="llama3-8b")
    parser.add_argument("--hf-context", type=int, default=512)
    parser.add_argument("--hf-steps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip HF compile past this")
    parser.add_argument("--no-fused", action="store_true", help="plain model forward in graphs")
    parser.add_argument(
        "--prefill-chunks",
        default="256,512,1024,2048",
        help="chunk sizes for a 2048-token prompt beside 32 decode rows (first model only)",
    )
    parser.add_argument(
        "--extras",
        default="",
        help="comma list: gemm (cuBLAS vs cuBLASLt over the decode GEMMs), sampler (paths), "
        "mixed (host profile of steps carrying a prefill chunk), skinny (split-K Triton GEMMs "
        "vs cuBLAS per projection and batch <= 64)",
    )
    parser.add_argument("--skip-check", action="store_true", help="no correctness check")
    parser.add_argument(
        "--mixed-graphs",
        action="store_true",
        help="EngineConfig.mixed_cuda_graphs (steps with prefill chunks from piecewise graphs; "
        "the prefill studies then run with and without them)",
    )
    parser.add_argument(
        "--blas",
        default=None,
        choices=["cublas", "cublaslt"],
        help="EngineConfig.decode_blas_library",
    )
    parser.add_argument(
        "--variants",
        default="async,sync",
        help="engine variants timed per (batch, context), the first as system 'harli', the "
        "others as 'harli_<variant>': sync, async (EngineConfig.async_scheduling), skinny "
        "(async + split-K Triton GEMMs for q|k|v and o at batch <= 64), skinny-all (all four "
        "projections); skinny variants re-capture the decode graphs and run batches <= 64",
    )
    parser.add_argument("--quick", action="store_true", help="smoke: llama, batch 8/64, ctx 512")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="kernel-time breakdown of decode steps and an attention sweep",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    args = parser.parse_args()
    if args.profile:
        from decode_profile import run_profile

        run_profile(args)
        return
    if args.quick:
        args.models, args.batches, args.contexts = "llama3-8b", "8,64", "512"
        args.hf_eager, args.hf_compile, args.steps = "64", "", 20
    started = time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    hf_eager = [int(b) for b in args.hf_eager.split(",") if b]
    hf_compile = [int(b) for b in args.hf_compile.split(",") if b]
    torch.backends.cuda.matmul.allow_tf32 = True

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    correctness = {} if args.skip_check else check_correctness()
    print("correctness", correctness, flush=True)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    extras = [e for e in args.extras.split(",") if e]
    chunks = [int(c) for c in args.prefill_chunks.split(",") if c]
    studies: dict[str, Any] = {}
    if "sampler" in extras:
        from decode_profile import sampler_paths

        studies["sampler_paths"] = sampler_paths(batches)

    def add_row(
        model_name: str,
        system: str,
        batch: int,
        context: int,
        res: dict[str, Any],
        config: ModelConfig,
    ) -> None:
        floor_bytes = (
            weight_bytes_read(config) + batch * res["mean_context"] * config.kv_bytes_per_token()
        )
        floor_ms = floor_bytes / bandwidth * 1e3
        p50 = statistics.median(res["step_ms"])
        row = {
            "model": model_name,
            "system": system,
            "batch": batch,
            "context": context,
            "tpot_ms_p50": round(p50, 4),
            "tpot_ms_p99": round(percentile(res["step_ms"], 99), 4),
            "floor_ms": round(floor_ms, 4),
            "bandwidth_frac": round(floor_ms / p50, 4),
            "n_steps": len(res["step_ms"]),
            "raw_step_ms": [round(x, 4) for x in res["step_ms"]],
        }
        if res.get("phases"):
            # host work not overlapped with the device = step wall time - wait at the sync
            for name, values in res["phases"].items():
                row[f"{name}_ms_p50"] = round(statistics.median(values), 4)
            host = [t - w for t, w in zip(res["step_ms"], res["phases"]["wait"], strict=True)]
            row["host_ms_p50"] = round(statistics.median(host), 4)
        if res.get("graph_ms"):
            row["graph_replay_ms_p50"] = round(statistics.median(res["graph_ms"]), 4)
            row["graph_replay_bandwidth_frac"] = round(floor_ms / row["graph_replay_ms_p50"], 4)
        rows.append(row)
        write_result(complete=False)
        print(
            f"{model_name:11s} {system:10s} b={batch:3d} ctx={context:4d} p50={p50:8.3f} "
            f"floor={floor_ms:7.3f} frac={floor_ms / p50:.3f} "
            f"graph={row.get('graph_replay_ms_p50')} host={row.get('host_ms_p50')}",
            flush=True,
        )

    def write_result(complete: bool) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
        """Write the result file (after every row, so a killed run keeps what it measured)."""
        all_rows = list(rows)
        for row in rows:
            if row["system"] == "harli":
                all_rows.append(
                    {k: row[k] for k in ("model", "batch", "context", "floor_ms")}
                    | {
                        "system": "floor",
                        "tpot_ms_p50": row["floor_ms"],
                        "tpot_ms_p99": row["floor_ms"],
                        "bandwidth_frac": 1.0,
                    }
                )
        ratios = []
        for row in all_rows:
            if row["system"] in ("hf_eager", "hf_compile"):
                ours = [
                    r
                    for r in rows
                    if r["system"] == "harli"
                    and r["model"] == row["model"]
                    and r["batch"] == row["batch"]
                    and r["context"] == row["context"]
                ]
                if ours:
                    ratios.append(
                        {
                            "model": row["model"],
                            "batch": row["batch"],
                            "context": row["context"],
                            "vs": row["system"],
                            "speedup": round(row["tpot_ms_p50"] / ours[0]["tpot_ms_p50"], 2),
                        }
                    )
        result = {
            "name": "decode",
            "commit": args.commit,
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "config": {
                "models": models,
                "batches": batches,
                "contexts": contexts,
                "steps": args.steps,
                "warmup": args.warmup,
                "hf_eager_batches": hf_eager,
                "hf_compile_batches": hf_compile,
                "hf_compile_models": args.hf_compile_models,
                "hf_context": args.hf_context,
                "hf_steps": args.hf_steps,
                "block_size": 16,
                "dtype": "bfloat16",
                "sampling": "temperature 0.8 (ours); greedy argmax (HF)",
                "fused_decode_kernels": not args.no_fused,
                "decode_blas_library": args.blas,
                "mixed_cuda_graphs": args.mixed_graphs,
                "variants": args.variants,
                "prefill_chunks": chunks,
                "extras": extras,
                "tpot": "wall time of Engine.step() incl. scheduling, input copy, graph replay, "
                "sampling and the host sync; graph_replay_ms is the graph alone (CUDA events)",
                "floor": "(weights except embedding table + batch KV at mean context) / "
                "copy bandwidth",
            },
            "copy_bandwidth_tb_s": round(bandwidth / 1e12, 4),
            "correctness": correctness,
            "rows": all_rows,
            "complete": complete,
            "speedups": ratios,
            "studies": studies,
            "notes": notes,
            "wall_s": round(time.perf_counter() - started, 1),
        }
        day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
        out = Path(args.out) / f"decode-h200-{day}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        return out, all_rows, ratios

    for name in models:
        try:
            config = ModelConfig.preset(name)
            model = build_random_model(config, seed=0, device=DEVICE, dtype="bfloat16")
            if "gemm" in extras and name == models[0]:
                from decode_profile import gemm_backends

                studies["gemm_backends"] = gemm_backends(model, bandwidth, batches)
                write_result(complete=False)
            prefill_prompt = 2048
            max_ctx = max(contexts + [args.hf_context] + ([prefill_prompt + 1] if chunks else []))
            extra = args.warmup + args.steps + 8
            # the prefill studies run 32 decode rows beside a new prompt
            seqs = max([*batches, *([64] if chunks or "mixed" in extras else [])])
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
            engine = Engine(model, engine_config, kv_storage_factory=random_storage)
            t0 = time.perf_counter()
            buckets = sorted({next(b for b in engine.runner._buckets if b >= x) for x in batches})
            engine.capture_cuda_graphs(batch_sizes=tuple(buckets))
            print(f"{name}: captured {buckets} in {time.perf_counter() - t0:.1f}s", flush=True)
            variants = [v for v in args.variants.split(",") if v]
            plain = [v for v in variants if not v.startswith("skinny")]
            for variant in plain:  # same graphs: only the scheduling mode changes
                set_variant(engine, variant, buckets)
                try:
                    for context in contexts:
                        for batch in batches:
                            res = time_engine(engine, batch, context, args.warmup, args.steps)
                            system = "harli" if variant == variants[0] else f"harli_{variant}"
                            add_row(name, system, batch, context, res, config)
                except Exception as exc:  # keep the other variants' rows; say what broke
                    import traceback

                    notes.append(f"{name} {variant} failed: {type(exc).__name__}: {exc}"[:600])
                    traceback.print_exc()
                    engine.config = dataclasses.replace(engine.config, async_scheduling=False)
                    engine._inflight = None
                    for rid in list(getattr(engine.scheduler, "requests", {})):
                        engine.abort_request(rid)
                    engine.step()
            # the chunk studies run synchronously, as the co-location loop runs the engine
            set_variant(engine, "sync", buckets)
            if "mixed" in extras and name == models[0]:
                from decode_profile import mixed_step_profile

                studies["mixed_step_profile"] = mixed_step_profile(engine)
                write_result(complete=False)
            if chunks and name == models[0]:
                studies["prefill_chunks"] = time_prefill_chunks(
                    engine, chunks, 32, min(contexts), prefill_prompt
                )
                write_result(complete=False)
            try:  # new kernels: a failure here keeps the rows above and the HF rows below
                if "skinny" in extras and name == models[0]:
                    from decode_profile import skinny_gemms

                    studies["skinny_gemms"] = skinny_gemms(model, bandwidth)
                    write_result(complete=False)
                for variant in [v for v in variants if v not in plain]:  # re-captured graphs
                    set_variant(engine, variant, [b for b in buckets if b <= 64])
                    for context in contexts:
                        for batch in [b for b in batches if b <= 64]:
                            res = time_engine(engine, batch, context, args.warmup, args.steps)
                            system = "harli" if variant == variants[0] else f"harli_{variant}"
                            add_row(name, system, batch, context, res, config)
            except Exception as exc:
                import traceback

                notes.append(f"{name} skinny GEMMs failed: {type(exc).__name__}: {exc}"[:600])
                traceback.print_exc()
            del engine
            torch.cuda.empty_cache()
            hf = hf_model(model)
            for batch in hf_eager:
                res = time_hf(model, hf, batch, args.hf_context, args.hf_steps, compiled=False)
                add_row(name, "hf_eager", batch, args.hf_context, res, config)
                torch.cuda.empty_cache()
            if name in args.hf_compile_models.split(","):
                for batch in hf_compile:
                    if time.perf_counter() - started > args.budget_s:
                        notes.append(f"hf_compile {name} batch {batch} skipped: time budget")
                        continue
                    try:
                        res = time_hf(
                            model, hf, batch, args.hf_context, args.hf_steps, compiled=True
                        )
                        add_row(name, "hf_compile", batch, args.hf_context, res, config)
                    except Exception as exc:  # report, do not hide: the row is missing for a reason
                        notes.append(
                            f"hf_compile {name} batch {batch} failed: {type(exc).__name__}: {exc}"[
                                :400
                            ]
                        )
                    torch._dynamo.reset()
                    torch.cuda.empty_cache()
            del hf, model
            torch.cuda.empty_cache()
        except Exception as exc:  # keep the other model's rows; say what broke
            import traceback

            notes.append(f"{name} failed: {type(exc).__name__}: {exc}"[:600])
            traceback.print_exc()
            torch.cuda.empty_cache()

    out, rows, ratios = write_result(complete=True)
    print(f"\nwrote {out}; notes: {notes}")
    print(
        f"{'model':11s} {'system':10s} {'batch':>5s} {'ctx':>5s} {'p50 ms':>8s} {'p99 ms':>8s} "
        f"{'floor':>7s} {'frac':>6s} {'graph':>7s}"
    )
    for r in rows:
        if r["system"] == "floor":
            continue
        print(
            f"{r['model']:11s} {r['system']:10s} {r['batch']:5d} {r['context']:5d} "
            f"{r['tpot_ms_p50']:8.3f} {r['tpot_ms_p99']:8.3f} {r['floor_ms']:7.3f} "
            f"{r['bandwidth_frac']:6.3f} {r.get('graph_replay_ms_p50', 0):7.3f}"
        )
    for s in ratios:
        print(f"speedup {s['model']} b={s['batch']} vs {s['vs']}: {s['speedup']}x")


if __name__ == "__main__":
    main()
