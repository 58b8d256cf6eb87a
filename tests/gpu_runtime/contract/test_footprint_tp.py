"""The finetune footprint sharded at tensor-parallel degree t: per GPU, column-parallel LoRA B
and row-parallel LoRA A split, the other halves replicate, activations divide by t; t = 1 is
the unsharded figure; KV heads replicate in whole copies past the KV-head count."""

from __future__ import annotations

import pytest

from gpu_runtime.contract.footprint import (
    ACTIVATION_BYTES_PER_UNIT,
    ADAPTER_STATE_BYTES_PER_PARAM,
    MIN_FINETUNE_BYTES,
    activation_bytes,
    adapter_parameter_count,
    finetune_footprint_bytes,
)
from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.tensor_parallel import TensorParallelError

# Llama-3-70B's shape: hidden 8192, 64 heads of 128, 8 KV heads, MLP 28672, 80 layers.
L70 = ModelConfig.preset("llama3-70b")


def test_degree_one_is_the_unsharded_figure() -> None:
    h, i, layers, r = 8192, 28672, 80, 16
    q, kv = 64 * 128, 8 * 128
    full = layers * r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    targets = ["all-linear"]
    assert adapter_parameter_count(L70, rank=r, target_modules=targets) == full
    assert adapter_parameter_count(L70, rank=r, target_modules=targets,
                                   tensor_parallel_size=1) == full  # fmt: skip
    tokens = 2048
    expected = (
        full * ADAPTER_STATE_BYTES_PER_PARAM + tokens * h * layers * ACTIVATION_BYTES_PER_UNIT
    )
    assert finetune_footprint_bytes(L70, rank=r, target_modules=targets, tokens=tokens) == expected
    assert finetune_footprint_bytes(L70, rank=r, target_modules=targets, tokens=tokens,
                                    tensor_parallel_size=1) == expected  # fmt: skip


def test_the_sharded_halves_divide_and_the_replicated_halves_stay() -> None:
    h, i, layers, r, t = 8192, 28672, 80, 8, 4
    q, kv = 64 * 128, 8 * 128
    # column-parallel (q, k, v, gate, up): A h x r whole, B r x out/t; row-parallel (o, down):
    # A in/t x r, B r x h whole
    per_rank = layers * r * ((h + q // t) + 2 * (h + kv // t) + (q // t + h)
                             + 2 * (h + i // t) + (i // t + h))  # fmt: skip
    assert adapter_parameter_count(L70, rank=r, target_modules=["all-linear"],
                                   tensor_parallel_size=t) == per_rank  # fmt: skip
    only_q = adapter_parameter_count(L70, rank=r, target_modules=["q_proj"], tensor_parallel_size=t)
    assert only_q == layers * r * (h + q // t)
    assert activation_bytes(L70, tokens=1000, tensor_parallel_size=t) == (
        -(-(1000 * h * layers * ACTIVATION_BYTES_PER_UNIT) // t)
    )


def test_kv_heads_replicate_past_the_kv_head_count() -> None:
    # tiny: 4 heads of 16, 2 KV heads: at t = 4 each rank holds one whole KV head
    tiny = ModelConfig.preset("tiny")
    d, layers = tiny.head_dim, tiny.num_hidden_layers
    k_only = adapter_parameter_count(
        tiny, rank=4, target_modules=["k_proj"], tensor_parallel_size=4
    )
    assert k_only == layers * 4 * (tiny.hidden_size + 1 * d)


def test_the_minimum_is_per_gpu_and_a_bad_degree_is_refused() -> None:
    tiny = ModelConfig.preset("tiny")
    assert finetune_footprint_bytes(tiny, rank=8, target_modules=["q_proj"], tokens=16,
                                    tensor_parallel_size=2) == MIN_FINETUNE_BYTES  # fmt: skip
    with pytest.raises(TensorParallelError, match="not divisible by tensor_parallel_size 3"):
        finetune_footprint_bytes(tiny, rank=8, target_modules=["q_proj"], tokens=16,
                                 tensor_parallel_size=3)  # fmt: skip
