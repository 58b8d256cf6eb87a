"""The two-stage latency model: roofline features, baked normalisation, two small nets.

``LatencyModel(x) -> (decode_alone_ms, decode_colocated_ms)`` for raw feature rows ``x``
``[N, 11]`` (``STAGE2_FEATURES`` order). Stage 1 predicts ``log(latency / roofline)`` of the decode
iteration alone; stage 2 predicts the log slowdown caused by the finetune quantum, gated to exactly
zero when ``ft_tokens == 0``, so ``colocated == alone`` without finetune. Everything, including
feature normalisation, is inside the module and therefore inside the exported ONNX graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gpu_runtime.predictor.schema import ModelShape
from predictor_models.roofline import COL, Hardware, decode_terms, finetune_terms

STAGE1_DERIVED = (
    "log_batch",
    "log_batch_bucket",
    "log_context_total",
    "log_context_mean",
    "log_context_max",
    "log_prefill",
    "decode_sm_share",
    "log_t_mem",
    "log_t_comp",
    "log_t_roof",
    "log_padded_kv_tokens",
)
STAGE2_DERIVED = (
    "log_batch",
    "decode_sm_share",
    "log_ft_tokens",
    "log_ft_seq_len",
    "log_ft_rank",
    "ft_backward",
    "ft_sm_share",
    "shares_sms",
    "log_ft_t_comp",
    "log_alone_pred",
    "mem_bound_frac",
)


def mlp(n_in: int, hidden: Sequence[int]) -> nn.Sequential:
    """``hidden=()`` is a linear model; the last layer starts at zero (prediction = prior)."""
    layers: list[nn.Module] = []
    width = n_in
    for h in hidden:
        layers += [nn.Linear(width, h), nn.SiLU()]
        width = h
    last = nn.Linear(width, 1)
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    layers.append(last)
    return nn.Sequential(*layers)


class Normalizer(nn.Module):
    """``(f - mean) / std`` with buffers set from training features."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))

    def fit(self, features: torch.Tensor) -> None:
        self.mean.copy_(features.mean(0))
        self.std.copy_(features.std(0).clamp(min=1e-6) if len(features) > 1 else self.std)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return (f - self.mean) / self.std


class LatencyModel(nn.Module):
    """Stage 1 and stage 2 decode-latency predictor over raw features (see module docstring)."""

    def __init__(
        self,
        shape: ModelShape,
        hw: Hardware,
        stage1_hidden: Sequence[int] = (16,),
        stage2_hidden: Sequence[int] = (16,),
    ) -> None:
        super().__init__()
        self.shape, self.hw = shape, hw
        self.stage1_hidden, self.stage2_hidden = tuple(stage1_hidden), tuple(stage2_hidden)
        self.norm1 = Normalizer(len(STAGE1_DERIVED))
        self.norm2 = Normalizer(len(STAGE2_DERIVED))
        self.net1 = mlp(len(STAGE1_DERIVED), stage1_hidden)
        self.net2 = mlp(len(STAGE2_DERIVED), stage2_hidden)

    def stage1_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(derived features [N, 11], roofline ms [N]).

        ``log_batch_bucket``: decode steps replay CUDA graphs captured for power-of-two batch
        buckets, so the GEMMs' cost follows the bucket rather than the batch.
        """
        d = decode_terms(x, self.shape, self.hw)
        b, ctx_max = x[:, COL["batch_size"]], x[:, COL["context_tokens_max"]]
        bucket = torch.exp2(torch.ceil(torch.log2(b.clamp(min=1.0))))
        f = torch.stack(
            [
                torch.log1p(b),
                torch.log(bucket),
                torch.log1p(x[:, COL["context_tokens_total"]]),
                torch.log1p(x[:, COL["context_tokens_mean"]]),
                torch.log1p(ctx_max),
                torch.log1p(x[:, COL["prefill_chunk_tokens"]]),
                x[:, COL["decode_sm_share"]],
                torch.log(d["t_mem"]),
                torch.log(d["t_comp"]),
                torch.log(d["t_roof"]),
                torch.log1p(b * ctx_max),
            ],
            dim=1,
        )
        return f, d["t_roof"]

    def stage2_features(
        self, x: torch.Tensor, f1: torch.Tensor, alone_ms: torch.Tensor
    ) -> torch.Tensor:
        """Derived features [N, 11] of the finetune quantum beside the iteration.

        ``shares_sms`` is 1 when the decode and finetune shares add up to more than the device
        (time sharing on streams) and 0 for a spatial split.
        """
        ft = finetune_terms(x, self.shape, self.hw)
        d = decode_terms(x, self.shape, self.hw)
        decode_share, ft_share = x[:, COL["decode_sm_share"]], x[:, COL["ft_sm_share"]]
        return torch.stack(
            [
                f1[:, 0],
                decode_share,
                torch.log1p(x[:, COL["ft_tokens"]]),
                torch.log(x[:, COL["ft_seq_len"]].clamp(min=1)),
                torch.log(x[:, COL["ft_lora_rank"]].clamp(min=1)),
                x[:, COL["ft_backward"]],
                ft_share,
                (decode_share + ft_share > 1.0 + 1e-6).to(x.dtype),
                torch.log(ft["t_comp"] + 1e-3),
                torch.log(alone_ms),
                d["t_mem"] / d["t_roof"],
            ],
            dim=1,
        )

    def alone(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stage-1 ms [N], stage-1 derived features)."""
        f1, t_roof = self.stage1_features(x)
        return t_roof * torch.exp(self.net1(self.norm1(f1)).squeeze(-1)), f1

    def log_slowdown(
        self, x: torch.Tensor, f1: torch.Tensor, alone_ms: torch.Tensor
    ) -> torch.Tensor:
        """Stage-2 log(colocated / alone) [N], exactly 0 where ft_tokens == 0."""
        f2 = self.stage2_features(x, f1, alone_ms)
        gate = (x[:, COL["ft_tokens"]] > 0).to(x.dtype)
        return self.net2(self.norm2(f2)).squeeze(-1) * gate

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alone_ms, f1 = self.alone(x)
        return alone_ms, alone_ms * torch.exp(self.log_slowdown(x, f1, alone_ms))
