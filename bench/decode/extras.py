"""The studies of ``bench/decode/run.py --extras``, each on one GPU beside the TPOT sweep:
`gemm_backends` (gemm: a decode step's GEMMs per kind, cuBLAS vs cuBLASLt), `sampler_paths`
(sampler: the sampling paths' device and host time) and `mixed_step_profile` (mixed: the host
side of steps carrying a prefill chunk).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.common.timing import event_times
from bench.decode.engine import DEVICE, inject
from gpu_runtime.engine import Engine


def _decode_gemm_weights(model: Any) -> dict[str, list[torch.Tensor]]:
    """The weights a decode step multiplies by, per kind, in layer order."""
    model.fuse_projections()
    kinds: dict[str, list[torch.Tensor]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for layer in model.decoder_layers:
        kinds["qkv"].append(layer.self_attn.qkv_weight)
        kinds["o"].append(layer.self_attn.o_proj.weight)
        kinds["gate_up"].append(layer.mlp.gate_up_weight)
        kinds["down"].append(layer.mlp.down_proj.weight)
    kinds["lm_head"] = [model.lm_head.weight]
    return kinds


@torch.no_grad()
def gemm_backends(
    model: Any, bandwidth: float, batches: list[int], reps: int = 5
) -> list[dict[str, Any]]:
    """A decode step's GEMMs alone (`F.linear` over the model's own weights, every layer in
    order, so no weight stays in L2; replayed from one CUDA graph per kind), per batch and BLAS
    library (cuBLAS, cuBLASLt): ms per step and the weight bytes over the copy bandwidth as a
    fraction of it."""
    import torch.nn.functional as F

    kinds = _decode_gemm_weights(model)
    results = []
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            for batch in batches:
                row: dict[str, Any] = {"library": library, "batch": batch}
                total_ms, total_bytes = 0.0, 0
                for kind, weights in kinds.items():
                    x = torch.randn(
                        batch, weights[0].shape[1], device=DEVICE, dtype=weights[0].dtype
                    )
                    for w in weights:  # warm-up (heuristics, workspace)
                        F.linear(x, w)
                    # replayed from a CUDA graph, as in the decode step: eager launches of the
                    # small GEMMs would time the host, not the GEMMs
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for w in weights:
                            F.linear(x, w)
                    times = event_times(graph.replay, reps)
                    del graph
                    ms = statistics.median(times)
                    nbytes = sum(w.numel() * w.element_size() for w in weights)
                    row[f"{kind}_ms"] = round(ms, 4)
                    row[f"{kind}_frac"] = round(nbytes / bandwidth * 1e3 / ms, 4)
                    total_ms += ms
                    total_bytes += nbytes
                row["total_ms"] = round(total_ms, 4)
                row["bandwidth_frac"] = round(total_bytes / bandwidth * 1e3 / total_ms, 4)
                results.append(row)
                print("gemm", row, flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    return results


def _sampler_calls(
    logits: torch.Tensor, sampling: Any, inv: torch.Tensor, seeds: torch.Tensor
) -> dict[str, Any]:
    from gpu_runtime.engine.sampler import Sampler
    from gpu_runtime.engine.sampling_kernels import gumbel_argmax

    torch_sampler = Sampler(DEVICE, seed=0, fused=False)
    split_sampler = Sampler(DEVICE, seed=0, fused=True, fused_min_rows=1)
    return {
        "torch_passes": lambda: torch_sampler.sample(logits, sampling).token_ids,
        "split_kernel": lambda: split_sampler.sample(logits, sampling).token_ids,
        "one_program_per_row": lambda: gumbel_argmax(logits, inv, seeds, parts=1),
        "greedy_argmax": lambda: logits.argmax(-1),
    }


@torch.no_grad()
def sampler_paths(batches: list[int], vocab: int = 128256, reps: int = 30) -> list[dict[str, Any]]:
    """Sampling one token per row from bf16 logits `[B, vocab]` at temperature 0.8: the torch
    passes, the split-vocabulary kernels (default) and one program per row (`parts=1`, the
    previous kernel); greedy argmax for reference. Device ms (CUDA events) and host ms of the
    launches (wall time until the call returns)."""
    import time

    from gpu_runtime.engine.request import SamplingParams
    from gpu_runtime.engine.sampler import SamplingBatch

    results = []
    params = SamplingParams(temperature=0.8)
    for batch in batches:
        logits = torch.randn(batch, vocab, device=DEVICE).to(torch.bfloat16)
        sampling = SamplingBatch([params] * batch, [0] * batch)
        inv = torch.full((batch,), 1 / 0.8, device=DEVICE)
        seeds = torch.arange(batch, device=DEVICE)
        paths = _sampler_calls(logits, sampling, inv, seeds)
        from gpu_runtime.engine.sampling_kernels import gumbel_argmax

        split_tokens = gumbel_argmax(logits, inv, seeds)
        if not torch.equal(split_tokens, gumbel_argmax(logits, inv, seeds, parts=1)):
            raise AssertionError(f"split and one-program sampling differ at batch {batch}")
        row: dict[str, Any] = {"batch": batch, "vocab": vocab}
        for name, fn in paths.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            device_ms, host_ms = [], []
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(reps):
                torch.cuda._sleep(1_000_000)  # launches queue behind busy work, as in a step
                s.record()
                t0 = time.perf_counter()
                fn()
                host_ms.append((time.perf_counter() - t0) * 1e3)
                e.record()
                e.synchronize()
                device_ms.append(s.elapsed_time(e))
            row[f"{name}_device_ms"] = round(statistics.median(device_ms), 4)
            row[f"{name}_host_ms"] = round(statistics.median(host_ms), 4)
        results.append(row)
        print("sampler", row, flush=True)
    return results


def mixed_step_profile(
    engine: Engine, cases: tuple[tuple[int, int], ...] = ((1, 64), (32, 512)), reps: int = 3
) -> list[dict[str, Any]]:
    """Steps that carry a prefill chunk (`rows` decode rows at context 512 + one new prompt of
    `chunk` tokens, all in one step): wall time, the host phases (`Engine.last_step_times`)
    and the Python functions with the most own time (cProfile over `reps` more such steps;
    the timed steps run without the profiler)."""
    import cProfile
    import pstats
    import time

    from gpu_runtime.engine import SamplingParams

    results = []
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    modes = [False, True] if engine.config.mixed_cuda_graphs else [False]
    for graphs, (rows, chunk) in [(g, c) for g in modes for c in cases]:
        engine.runner.general.use_mixed_graphs = graphs
        ids = inject(engine, rows, 512, 64, seed=99 + rows + 7 * graphs)
        engine.step()  # decode step, then one warm mixed step (compiles)
        walls, phases = [], []
        profiler = cProfile.Profile()
        for rep in range(2 * reps + 1):  # warm-up, timed steps, profiled steps
            prompt = torch.randint(0, vocab, (chunk,), generator=gen).tolist()
            rid = engine.add_request(
                prompt, params, request_id=f"mixed-{graphs}-{rows}-{chunk}-{rep}"
            )
            profiled = rep > reps
            if profiled:
                profiler.enable()
            t0 = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - t0
            if profiled:
                profiler.disable()
            elif rep > 0:
                walls.append(wall * 1e3)
                phases.append([round(t * 1e3, 3) for t in engine.last_step_times])
            assert any(o.request_id == rid and o.finished for o in outputs)
        stats = pstats.Stats(profiler)
        top = sorted(
            ((v[2], v[0], f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}") for k, v in stats.stats.items()),  # type: ignore[attr-defined]
            reverse=True,
        )[:30]
        for rid in ids:
            engine.abort_request(rid)
        own_time = [(name, round(own * 1e3 / reps, 3), calls // reps) for own, calls, name in top]
        row = {
            "mixed_graphs": graphs,
            "decode_rows": rows,
            "chunk": chunk,
            "step_ms": [round(w, 3) for w in walls],
            "phases_ms (schedule, launch, sample, wait, post)": phases,
        }
        print("mixed", row, flush=True)
        for name, own_ms, calls in own_time[:25]:
            print(
                f"mixed-top {rows}+{chunk} graphs={graphs}: {own_ms:8.3f} ms {calls:6d} {name}",
                flush=True,
            )
        row["top_own_time_ms_per_step"] = own_time
        results.append(row)
    engine.runner.general.use_mixed_graphs = True
    return results
