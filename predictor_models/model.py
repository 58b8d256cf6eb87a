"""The two-stage latency model: roofline features, baked normalisation, two small nets.

``LatencyModel(x) -> (decode_alone_ms, decode_colocated_ms)`` for raw feature rows ``x``
``[N, 11]`` (``STAGE2_FEATURES`` order). Stage 1 predicts ``log(latency / roofline)`` of the decode
iteration alone; stage 2 predicts the log slowdown caused by the finetune quantum, gated to exactly
zero when ``ft_tokens == 0``, so ``colocated == alone`` without finetune. Everything, including
feature normalisation, is inside the module and therefore inside the exported ONNX graph.

Stage 1 has two networks: one for decode-only steps (replayed from the decode graph of the
batch's bucket) and one for steps carrying prompt chunks (the mixed-step graphs of the token
bucket holding decode rows + chunk tokens, attention eager); a step's prediction uses exactly
one of them (``0/1`` gates on ``prefill_chunk_tokens > 0``). The buckets are the deployment's
(``batch_buckets``: ``EngineConfig.graph_batch_sizes()``; ``token_buckets``:
``EngineConfig.mixed_graph_token_sizes()``), recorded in the profile's metadata; the log of a
step's bucket is a sum of 0/1 steps, one per bucket boundary, so any bucket list is exact.
The chunk network also reads one 0/1 step per boundary between the profiled decode SM splits
(``share_splits``): a chunk step is not monotone in its share, which a smooth function of the
share does not follow (docs/decisions/0012-latency-model.md).
Stage 2 reads the decode network's estimate (its rows are decode-only steps).

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
from predictor_models.buckets import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_TOKEN_BUCKETS,
    STEP_SCALE,
    share_thresholds,
    step_thresholds,
)
from predictor_models.features import (
    BLOCK,
    CHUNK_DERIVED,
    LN2,
    N_LOG,
    STAGE1_DERIVED,
    STAGE2_DERIVED,
    linear_block,
)
from predictor_models.layers import Normalizer, mlp
from predictor_models.roofline import COL, Hardware

# The building blocks live in features, buckets and layers; they stay importable from here.
__all__ = [
    "BLOCK",
    "CHUNK_DERIVED",
    "DEFAULT_BATCH_BUCKETS",
    "DEFAULT_TOKEN_BUCKETS",
    "LN2",
    "LatencyModel",
    "N_LOG",
    "Normalizer",
    "STAGE1_DERIVED",
    "STAGE2_DERIVED",
    "STEP_SCALE",
    "linear_block",
    "mlp",
    "share_thresholds",
    "step_thresholds",
]


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
        chunk_hidden: Sequence[int] = (),
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        token_buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS,
        share_splits: Sequence[float] = (),
    ) -> None:
        super().__init__()
        self.shape, self.hw = shape, hw
        self.stage1_hidden, self.stage2_hidden = tuple(stage1_hidden), tuple(stage2_hidden)
        self.chunk_hidden = tuple(chunk_hidden)
        self.batch_buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
        self.token_buckets = tuple(sorted(set(int(b) for b in token_buckets)))
        self.batch_steps = step_thresholds(self.batch_buckets)
        self.token_steps = step_thresholds(self.token_buckets)
        self.share_splits = tuple(sorted(set(float(s) for s in share_splits)))
        self.share_steps = share_thresholds(self.share_splits)
        self.chunk_derived = CHUNK_DERIVED + tuple(
            f"decode_sm_share>{math.exp(t):.4f}" for t in self.share_steps
        )
        block_a, block_c = linear_block(shape, hw)
        self.register_buffer("block_a", block_a)
        self.register_buffer("block_c", block_c)
        self.norm1 = Normalizer(len(STAGE1_DERIVED))
        self.normc = Normalizer(len(self.chunk_derived))
        self.norm2 = Normalizer(len(STAGE2_DERIVED))
        self.net1 = mlp(len(STAGE1_DERIVED), stage1_hidden)
        self.netc = mlp(len(self.chunk_derived), chunk_hidden)
        self.net2 = mlp(len(STAGE2_DERIVED), stage2_hidden)

    def block(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logs of the positive block columns [N, N_LOG], the raw columns [N, 5])."""
        linear = x @ self.block_a + self.block_c
        return torch.log(linear[:, :N_LOG]), linear[:, N_LOG:]

    @staticmethod
    def log_bucket(
        log_value: torch.Tensor, steps: tuple[list[float], list[float]], first: int
    ) -> torch.Tensor:
        """``log`` of the smallest bucket holding each value (``[N, 1]`` logs in and out)."""
        out = torch.full_like(log_value, math.log(first))
        for threshold, increment in zip(*steps, strict=True):
            above = torch.ceil(torch.relu(log_value * STEP_SCALE - threshold * STEP_SCALE))
            out = out + above * increment
        return out

    @staticmethod
    def chunk_gate(x: torch.Tensor) -> torch.Tensor:
        """``[N, 1]``: 1 for a step carrying prompt chunks (``prefill_chunk_tokens`` > 0.5:
        token counts are integers), 0 for a decode-only step."""
        col = COL["prefill_chunk_tokens"]
        return (x[:, col : col + 1] > 0.5).to(x.dtype)

    def stage1_features(
        self, x: torch.Tensor, block: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(decode-step features [N, 11] (STAGE1_DERIVED), roofline ms [N]).

        ``log_batch_bucket``: decode steps replay the CUDA graph captured for the batch's
        bucket, so the GEMMs' cost follows the bucket rather than the batch.
        """
        logs, raw = block if block is not None else self.block(x)
        log_t_comp = logs[:, 7:8] - logs[:, 5:6]  # 2-D slices: no gather/unsqueeze in ONNX
        log_t_roof = torch.maximum(logs[:, 6:7], log_t_comp)
        log_bucket = self.log_bucket(logs[:, 12:13], self.batch_steps, self.batch_buckets[0])
        f1 = torch.cat([logs[:, :8], log_bucket, log_t_roof, raw[:, :1]], dim=1)
        return f1, torch.exp(log_t_roof[:, 0])

    def chunk_features(
        self, x: torch.Tensor, block: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Features [N, 12 + share steps] (``chunk_derived``) of a step with prompt chunks: the
        token bucket of its mixed-step graphs (decode rows + chunk tokens) instead of the batch
        bucket, and the share's 0/1 steps (``log_share > t`` as ``ceil(relu(.))``, the same
        form as the bucket boundaries)."""
        logs, raw = block if block is not None else self.block(x)
        f1, _ = self.stage1_features(x, (logs, raw))
        log_tokens = logs[:, 13:14]
        log_bucket = self.log_bucket(log_tokens, self.token_steps, self.token_buckets[0])
        log_share = logs[:, 5:6]
        steps = [
            torch.ceil(torch.relu(log_share * STEP_SCALE - t * STEP_SCALE))
            for t in self.share_steps
        ]
        return torch.cat([f1[:, :8], log_bucket, log_tokens, f1[:, 9:11], *steps], dim=1)

    def stage2_features(
        self,
        x: torch.Tensor,
        f1: torch.Tensor,
        alone_ms: torch.Tensor,
        block: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Derived features [N, 11] of the finetune quantum beside the iteration.

        ``alone_ms`` is the decode network's estimate (``alone(x, decode_net_only=True)``).
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

    def _log_alone(
        self, x: torch.Tensor, block: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log alone ms [N, 1], the decode network's log alone ms [N, 1], f1)."""
        f1, _ = self.stage1_features(x, block)
        log_roof = f1[:, 9:10]
        decode = self.net1(self.norm1(f1))
        chunk = self.netc(self.normc(self.chunk_features(x, block)))
        gate = self.chunk_gate(x)
        return log_roof + decode * (1.0 - gate) + chunk * gate, log_roof + decode, f1

    def alone(
        self,
        x: torch.Tensor,
        block: tuple[torch.Tensor, torch.Tensor] | None = None,
        decode_net_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(stage-1 ms [N], stage-1 derived features); ``decode_net_only``: the decode
        network's estimate for every row (what stage 2 reads)."""
        block = block if block is not None else self.block(x)
        log_alone, log_decode, f1 = self._log_alone(x, block)
        return torch.exp((log_decode if decode_net_only else log_alone)[:, 0]), f1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logs, raw = self.block(x)
        log_alone, log_decode, f1 = self._log_alone(x, (logs, raw))
        shares_sms = (raw[:, 3:4] > 1.0 + 1e-6).to(x.dtype)
        f2 = torch.cat(
            [
                logs[:, :1],
                raw[:, :1],
                logs[:, 8:12],
                raw[:, 1:3],
                shares_sms,
                log_decode,
                logs[:, 6:7] - f1[:, 9:10],
            ],
            dim=1,
        )  # == stage2_features(x, f1, exp(log_decode)), without the exp/log round trip
        gate = (raw[:, 4:5] > 0).to(x.dtype)
        log_colocated = log_alone + self.net2(self.norm2(f2)) * gate
        return torch.exp(log_alone).squeeze(-1), torch.exp(log_colocated).squeeze(-1)

    def fold_normalization(self) -> LatencyModel:
        """Fold the normalisers into their nets' first layers (in place); returns self."""
        for norm, net in (
            (self.norm1, self.net1),
            (self.normc, self.netc),
            (self.norm2, self.net2),
        ):
            if not norm.folded:
                first = net[0]
                assert isinstance(first, nn.Linear)
                norm.fold_into(first)
        return self
