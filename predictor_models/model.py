"""The two-stage latency model: roofline features, baked normalisation, two small nets.

``LatencyModel(x) -> (decode_alone_ms, decode_colocated_ms)`` for raw feature rows ``x``
``[N, 11]`` (``STAGE2_FEATURES`` order). Stage 1 predicts ``log(latency / roofline)`` of the decode
iteration alone; stage 2 predicts the log slowdown caused by the finetune quantum, gated to exactly
zero when ``ft_tokens == 0``, so ``colocated == alone`` without finetune. Everything, including
feature normalisation, is inside the module and therefore inside the exported ONNX graph.

For a small ONNX graph (the runtime must score 64 candidates in tens of microseconds) every
quantity the features need that is linear in the raw features comes out of ONE matrix product
``x @ A + c`` (roofline bytes and FLOPs included: the model shape and hardware ceilings are baked
into ``A`` and ``c``), followed by one elementwise log. The roofline here drops the prefill chunk's
quadratic attention FLOPs and the quantum's attention FLOPs (under 2% of their GEMM FLOPs at
P <= 512 and S <= 2048 for 7-8B shapes); ``predictor_models.roofline`` keeps them for the baseline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from gpu_runtime.predictor.schema import ModelShape
from predictor_models.roofline import COL, Hardware

LN2 = math.log(2.0)
# Columns of the linear block L = x @ A + c. The first N_LOG are strictly positive and are
# logged; the rest are used as they are.
BLOCK = (
    "1+batch",
    "1+context_total",
    "1+context_mean",
    "1+context_max",
    "1+prefill",
    "decode_sm_share",
    "t_mem_ms",
    "t_comp_ms*share",
    "1+ft_tokens",
    "ft_seq_len",
    "ft_lora_rank",
    "ft_sm_share+eps",
    "batch+eps",
    "decode_sm_share_raw",
    "ft_backward",
    "ft_sm_share",
    "share_sum",
    "ft_tokens",
)
N_LOG = 13
STAGE1_DERIVED = (
    "log_1p_batch",
    "log_1p_context_total",
    "log_1p_context_mean",
    "log_1p_context_max",
    "log_1p_prefill",
    "log_decode_sm_share",
    "log_t_mem",
    "log_t_comp_x_share",
    "log_batch_bucket",
    "log_t_roof",
    "decode_sm_share",
)
STAGE2_DERIVED = (
    "log_1p_batch",
    "decode_sm_share",
    "log_1p_ft_tokens",
    "log_ft_seq_len",
    "log_ft_rank",
    "log_ft_sm_share",
    "ft_backward",
    "ft_sm_share",
    "shares_sms",
    "log_alone_pred",
    "log_mem_over_roof",
)


def linear_block(shape: ModelShape, hw: Hardware) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [11, len(BLOCK)], c [len(BLOCK)]) of the block ``x @ A + c`` (see BLOCK)."""
    a = torch.zeros(len(COL), len(BLOCK), dtype=torch.float64)
    c = torch.zeros(len(BLOCK), dtype=torch.float64)
    col = {name: i for i, name in enumerate(BLOCK)}
    for j, feature in enumerate(
        (
            "batch_size",
            "context_tokens_total",
            "context_tokens_mean",
            "context_tokens_max",
            "prefill_chunk_tokens",
        )
    ):
        a[COL[feature], j] = 1.0
        c[j] = 1.0
    a[COL["decode_sm_share"], col["decode_sm_share"]] = 1.0
    kv = shape.kv_bytes_per_token / hw.hbm_bytes_per_ms
    for feature in ("context_tokens_total", "batch_size", "prefill_chunk_tokens"):
        a[COL[feature], col["t_mem_ms"]] = kv
    c[col["t_mem_ms"]] = shape.weight_bytes / hw.hbm_bytes_per_ms
    gemm = 2.0 * shape.linear_params / hw.flops_per_ms
    attn = shape.attention_flops_per_query_key / hw.flops_per_ms
    a[COL["batch_size"], col["t_comp_ms*share"]] = gemm + attn
    a[COL["prefill_chunk_tokens"], col["t_comp_ms*share"]] = gemm
    a[COL["context_tokens_total"], col["t_comp_ms*share"]] = attn
    a[COL["ft_tokens"], col["1+ft_tokens"]] = 1.0
    c[col["1+ft_tokens"]] = 1.0
    a[COL["ft_seq_len"], col["ft_seq_len"]] = 1.0
    a[COL["ft_lora_rank"], col["ft_lora_rank"]] = 1.0
    a[COL["ft_sm_share"], col["ft_sm_share+eps"]] = 1.0
    c[col["ft_sm_share+eps"]] = 1e-3
    a[COL["batch_size"], col["batch+eps"]] = 1.0
    c[col["batch+eps"]] = 1e-6
    a[COL["decode_sm_share"], col["decode_sm_share_raw"]] = 1.0
    a[COL["ft_backward"], col["ft_backward"]] = 1.0
    a[COL["ft_sm_share"], col["ft_sm_share"]] = 1.0
    a[COL["decode_sm_share"], col["share_sum"]] = 1.0
    a[COL["ft_sm_share"], col["share_sum"]] = 1.0
    a[COL["ft_tokens"], col["ft_tokens"]] = 1.0
    return a.float(), c.float()


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
    """``(f - mean) / std`` with buffers set from training features.

    A feature that is constant in training gets ``std = inf`` (it normalises to 0): it carried no
    information there, and dividing by a tiny std would turn any other value into an enormous
    input (e.g. prefill-chunk tokens when every profiled iteration had none, which drove
    predictions to 0 ms); such a feature acts only through the roofline terms.

    ``fold_into(linear)`` moves the normalisation into the next layer's weights (exactly the
    same function, two fewer ops in the exported graph) and turns this module into identity.
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))
        self.folded = False

    def fit(self, features: torch.Tensor) -> None:
        self.mean.copy_(features.mean(0))
        if len(features) > 1:
            std = features.std(0)
            self.std.copy_(torch.where(std > 1e-6, std, math.inf))

    @torch.no_grad()
    def fold_into(self, linear: nn.Linear) -> None:
        scaled = linear.weight / self.std  # [out, in]
        linear.bias.sub_(scaled @ self.mean)
        linear.weight.copy_(scaled)
        self.mean.zero_()
        self.std.fill_(1.0)
        self.folded = True

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return f if self.folded else (f - self.mean) / self.std


class LatencyModel(nn.Module):
    """Stage 1 and stage 2 decode-latency predictor over raw features (see module docstring)."""

    block_a: torch.Tensor
    block_c: torch.Tensor

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
        block_a, block_c = linear_block(shape, hw)
        self.register_buffer("block_a", block_a)
        self.register_buffer("block_c", block_c)
        self.norm1 = Normalizer(len(STAGE1_DERIVED))
        self.norm2 = Normalizer(len(STAGE2_DERIVED))
        self.net1 = mlp(len(STAGE1_DERIVED), stage1_hidden)
        self.net2 = mlp(len(STAGE2_DERIVED), stage2_hidden)

    def block(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logs of the positive block columns [N, 13], the raw columns [N, 5])."""
        linear = x @ self.block_a + self.block_c
        return torch.log(linear[:, :N_LOG]), linear[:, N_LOG:]

    def stage1_features(
        self, x: torch.Tensor, block: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(derived features [N, 11], roofline ms [N]).

        ``log_batch_bucket``: decode steps replay CUDA graphs captured for power-of-two batch
        buckets, so the GEMMs' cost follows the bucket rather than the batch (the epsilon keeps
        exact powers of two in their own bucket despite rounding).
        """
        logs, raw = block if block is not None else self.block(x)
        log_t_comp = logs[:, 7:8] - logs[:, 5:6]  # 2-D slices: no gather/unsqueeze in ONNX
        log_t_roof = torch.maximum(logs[:, 6:7], log_t_comp)
        log_bucket = torch.ceil(logs[:, 12:13] / LN2 - 1e-4) * LN2
        f1 = torch.cat([logs[:, :8], log_bucket, log_t_roof, raw[:, :1]], dim=1)
        return f1, torch.exp(log_t_roof[:, 0])

    def stage2_features(
        self,
        x: torch.Tensor,
        f1: torch.Tensor,
        alone_ms: torch.Tensor,
        block: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Derived features [N, 11] of the finetune quantum beside the iteration.

        ``shares_sms`` is 1 when the decode and finetune shares add up to more than the device
        (time sharing on streams) and 0 for a spatial split.
        """
        logs, raw = block if block is not None else self.block(x)
        shares_sms = (raw[:, 3:4] > 1.0 + 1e-6).to(x.dtype)
        return torch.cat(
            [
                logs[:, :1],
                raw[:, :1],
                logs[:, 8:12],
                raw[:, 1:3],
                shares_sms,
                torch.log(alone_ms)[:, None],
                logs[:, 6:7] - f1[:, 9:10],
            ],
            dim=1,
        )

    def alone(
        self, x: torch.Tensor, block: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(stage-1 ms [N], stage-1 derived features)."""
        f1, t_roof = self.stage1_features(x, block)
        return t_roof * torch.exp(self.net1(self.norm1(f1)).squeeze(-1)), f1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logs, raw = self.block(x)
        f1 = self.stage1_features(x, (logs, raw))[0]
        log_alone = f1[:, 9:10] + self.net1(self.norm1(f1))  # [N, 1]
        shares_sms = (raw[:, 3:4] > 1.0 + 1e-6).to(x.dtype)
        f2 = torch.cat(
            [
                logs[:, :1],
                raw[:, :1],
                logs[:, 8:12],
                raw[:, 1:3],
                shares_sms,
                log_alone,
                logs[:, 6:7] - f1[:, 9:10],
            ],
            dim=1,
        )  # == stage2_features(x, f1, exp(log_alone)), without the exp/log round trip
        gate = (raw[:, 4:5] > 0).to(x.dtype)
        log_colocated = log_alone + self.net2(self.norm2(f2)) * gate
        return torch.exp(log_alone).squeeze(-1), torch.exp(log_colocated).squeeze(-1)

    def fold_normalization(self) -> LatencyModel:
        """Fold both normalisers into their nets' first layers (in place); returns self."""
        for norm, net in ((self.norm1, self.net1), (self.norm2, self.net2)):
            if not norm.folded:
                first = net[0]
                assert isinstance(first, nn.Linear)
                norm.fold_into(first)
        return self
