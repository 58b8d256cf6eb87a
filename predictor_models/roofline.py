"""Roofline terms of a decode iteration and of a finetune quantum, and the roofline-only baseline.

All functions take the raw feature matrix ``x`` ``[N, len(STAGE2_FEATURES)]`` (column order of
``gpu_runtime.predictor.schema.STAGE2_FEATURES``) and are written in torch so that the exported
ONNX graph computes them itself: the runtime feeds raw features only.

Decode iteration with ``B`` decode sequences, total context ``C`` and a prefill chunk of ``P``:
  bytes = weights + KV(C + B) + KV(P)                     (every weight once, every cached K/V once)
  FLOPs = 2 * linear_params * (B + P) + attn * (C + B) + attn * P (P + 1) / 2
  t_mem = bytes / HBM bandwidth;  t_comp = FLOPs / (peak FLOP/s * decode SM share)
  roofline time = max(t_mem, t_comp)
Finetune quantum of ``T`` tokens, sequences of ``S``: FLOPs = 2 * linear_params * T (forward; a
LoRA backward with frozen base weights costs about the same) + attn * T * (S + 1) / 2, on the
finetune SM share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from gpu_runtime.predictor.schema import STAGE2_FEATURES, ModelShape

COL = {name: i for i, name in enumerate(STAGE2_FEATURES)}


@dataclass(frozen=True)
class Hardware:
    """Ceilings the roofline divides by, measured on the profiled GPU.

    Attributes:
        name: GPU name.
        hbm_bytes_per_ms: device-to-device copy bandwidth (read + write bytes per ms).
        flops_per_ms: dense bf16 matrix rate (FLOP per ms) on random data.
    """

    name: str
    hbm_bytes_per_ms: float
    flops_per_ms: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


H200 = Hardware(name="NVIDIA H200", hbm_bytes_per_ms=4.27e9, flops_per_ms=7.9e11)
"""bench/results/sharing-h200-20261130.json: 4.27 TB/s copy; 8192^3 bf16 GEMM 796 TFLOP/s."""


def decode_terms(x: torch.Tensor, shape: ModelShape, hw: Hardware) -> dict[str, torch.Tensor]:
    """Bytes, FLOPs and times (ms) of the decode iteration of each row of ``x``."""
    b, ctx, prefill = (
        x[:, COL["batch_size"]],
        x[:, COL["context_tokens_total"]],
        x[:, COL["prefill_chunk_tokens"]],
    )
    share = x[:, COL["decode_sm_share"]].clamp(min=1e-3)
    kv = float(shape.kv_bytes_per_token)
    attn = float(shape.attention_flops_per_query_key)
    bytes_moved = float(shape.weight_bytes) + kv * (ctx + b) + kv * prefill
    flops = 2.0 * float(shape.linear_params) * (b + prefill) + attn * (ctx + b)
    flops = flops + attn * prefill * (prefill + 1.0) / 2.0
    t_mem = bytes_moved / hw.hbm_bytes_per_ms
    t_comp = flops / (hw.flops_per_ms * share)
    return {
        "bytes": bytes_moved,
        "flops": flops,
        "t_mem": t_mem,
        "t_comp": t_comp,
        "t_roof": torch.maximum(t_mem, t_comp),
    }


def finetune_terms(x: torch.Tensor, shape: ModelShape, hw: Hardware) -> dict[str, torch.Tensor]:
    """FLOPs and compute time (ms) of the finetune quantum of each row (0 when none)."""
    tokens, seq = x[:, COL["ft_tokens"]], x[:, COL["ft_seq_len"]]
    share = x[:, COL["ft_sm_share"]].clamp(min=1e-3)
    attn = float(shape.attention_flops_per_query_key)
    flops = 2.0 * float(shape.linear_params) * tokens + attn * tokens * (seq + 1.0) / 2.0
    return {"flops": flops, "t_comp": flops / (hw.flops_per_ms * share)}


class RooflineBaseline:
    """Roofline time scaled by one efficiency per stage, fitted on training rows.

    Stage 2 uses the decode roofline too (a roofline knows nothing of interference); its own
    efficiency absorbs the average slowdown.
    """

    def __init__(self, shape: ModelShape, hw: Hardware) -> None:
        self.shape, self.hw = shape, hw
        self.efficiency = {1: 1.0, 2: 1.0}

    def roofline_ms(self, x: torch.Tensor) -> torch.Tensor:
        return decode_terms(x, self.shape, self.hw)["t_roof"]

    def fit(self, x: torch.Tensor, latency_ms: torch.Tensor, stage: int) -> RooflineBaseline:
        """Efficiency = median(roofline / measured) over the rows (robust to outliers)."""
        ratio = self.roofline_ms(x) / latency_ms
        self.efficiency[stage] = float(ratio.median())
        return self

    def predict(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        return self.roofline_ms(x) / self.efficiency[stage]
