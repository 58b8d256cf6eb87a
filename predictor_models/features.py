"""Feature layout of the latency model: the linear block and the derived feature names.

Every quantity the model's features need that is linear in the raw feature row ``x``
(``roofline.COL`` order) comes out of one matrix product ``x @ A + c`` (``linear_block``), with
the model shape and hardware ceilings baked into ``A`` and ``c``; the first ``N_LOG`` columns
are logged. ``STAGE1_DERIVED``, ``CHUNK_DERIVED`` and ``STAGE2_DERIVED`` name the columns each
network reads (``predictor_models.model.LatencyModel`` builds them).
"""

from __future__ import annotations

import math

import torch

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
    "tokens+eps",
    "decode_sm_share_raw",
    "ft_backward",
    "ft_sm_share",
    "share_sum",
    "ft_tokens",
)
N_LOG = 14
STEP_DERIVED = (
    "log_1p_batch",
    "log_1p_context_total",
    "log_1p_context_mean",
    "log_1p_context_max",
    "log_1p_prefill",
    "log_decode_sm_share",
    "log_t_mem",
    "log_t_comp_x_share",
)
"""The step's own columns, read by both decode-step networks."""
STAGE1_DERIVED = (*STEP_DERIVED, "log_batch_bucket", "log_t_roof", "decode_sm_share")
CHUNK_DERIVED = (
    *STEP_DERIVED,
    "log_token_bucket",
    "log_tokens",
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
    a[COL["batch_size"], col["tokens+eps"]] = 1.0
    a[COL["prefill_chunk_tokens"], col["tokens+eps"]] = 1.0
    c[col["tokens+eps"]] = 1e-6
    a[COL["decode_sm_share"], col["decode_sm_share_raw"]] = 1.0
    a[COL["ft_backward"], col["ft_backward"]] = 1.0
    a[COL["ft_sm_share"], col["ft_sm_share"]] = 1.0
    a[COL["decode_sm_share"], col["share_sum"]] = 1.0
    a[COL["ft_sm_share"], col["share_sum"]] = 1.0
    a[COL["ft_tokens"], col["ft_tokens"]] = 1.0
    return a.float(), c.float()
