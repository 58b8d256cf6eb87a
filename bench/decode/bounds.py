"""Lower bounds of one decode step for ``bench/decode/run.py``, beside the HBM floor: the compute
floor (the step's FLOPs over the bf16 dense GEMM throughput measured in the same run), the
serial bound (HBM floor + compute floor: what a step costs when no byte moves while the tensor
cores work) and the per-kernel roofline (each kernel costs the larger of its bytes over the
copy bandwidth and its FLOPs over the GEMM throughput; kernels run one after another).

Where the per-kernel roofline is well above the HBM floor, the step cannot reach the HBM floor
even with perfect kernels: at batch 256 the decode GEMMs are compute-bound (Llama-3-8B: ~3.8
TFLOP per step against ~15 GB of weights; at ~750 TFLOP/s and ~4.3 TB/s the GEMMs alone take
longer than reading the weights). Counted: the four projection groups per layer (q|k|v, o,
gate|up, down) and the LM head (weight bytes read once, 2 FLOPs per weight per row), paged
attention (K and V of every row at its context, 4 * heads * head_dim FLOPs per cached token);
not counted: activations (B x width, small), norms, RoPE, SwiGLU, sampling.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from bench.common.timing import event_times
from gpu_runtime.model import ModelConfig

BF16_BYTES = 2


def dense_throughput(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """bf16 dense GEMM throughput of this device in FLOP/s: an `n` x `n` x `n` matmul, median
    of `iters` timed with CUDA events after a warm-up (the largest the decode GEMMs could get)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    times = sorted(event_times(functools.partial(torch.matmul, a, b, out=out), iters))
    return 2 * n**3 / (times[len(times) // 2] / 1e3)


def step_kernels(config: ModelConfig, batch: int, context: float) -> list[tuple[str, int, float]]:
    """The step's heavy kernels once each: (name, bytes read from HBM, FLOPs), for `batch` rows
    at mean `context`; per-layer kernels are listed once with layer-summed figures."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    layers = config.num_hidden_layers
    kernels = []
    for name, k, n in (("qkv", h, q + 2 * kv), ("o", q, h), ("gate_up", h, 2 * i), ("down", i, h)):
        kernels.append((name, layers * k * n * BF16_BYTES, float(layers * 2 * batch * k * n)))
    kv_bytes = layers * batch * context * 2 * kv * BF16_BYTES
    kernels.append(("attention", int(kv_bytes), float(layers * 4 * batch * q * context)))
    kernels.append(("lm_head", h * v * BF16_BYTES, float(2 * batch * h * v)))
    return kernels


def step_bounds(
    config: ModelConfig,
    batch: int,
    context: float,
    floor_bw_ms: float,
    bandwidth: float,
    flops_per_s: float,
) -> dict[str, Any]:
    """The bounds of one step (ms) beside `floor_bw_ms` (the HBM floor of `report`):
    `step_tflop`, `floor_compute_ms`, `floor_serial_ms` (HBM floor + compute floor) and
    `floor_roofline_ms` (sum over kernels of max(bytes / bandwidth, FLOPs / throughput)),
    and the kernels whose FLOPs outlast their bytes (`compute_bound_kernels`)."""
    kernels = step_kernels(config, batch, context)
    flops = sum(f for _, _, f in kernels)
    compute_ms = flops / flops_per_s * 1e3
    roofline = 0.0
    compute_bound = []
    for name, nbytes, kernel_flops in kernels:
        memory_s, math_s = nbytes / bandwidth, kernel_flops / flops_per_s
        roofline += max(memory_s, math_s)
        if math_s > memory_s:
            compute_bound.append(name)
    return {
        "step_tflop": round(flops / 1e12, 4),
        "floor_compute_ms": round(compute_ms, 4),
        "floor_serial_ms": round(floor_bw_ms + compute_ms, 4),
        "floor_roofline_ms": round(roofline * 1e3, 4),
        "compute_bound_kernels": compute_bound,
    }
