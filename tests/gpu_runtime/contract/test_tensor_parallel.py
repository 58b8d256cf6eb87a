from __future__ import annotations

import dataclasses

import pytest

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.tensor_parallel import (
    TensorParallelError,
    check_tensor_parallel,
    kv_head_of_rank,
    kv_heads_per_rank,
    tensor_parallel_problem,
)


def test_70b_shapes_shard_at_every_degree_of_a_node() -> None:
    for name in ("llama3-70b", "qwen2.5-72b", "llama3-8b"):
        config = ModelConfig.preset(name)
        assert [tensor_parallel_problem(config, s) for s in (1, 2, 4, 8)] == [None] * 4
        assert [kv_heads_per_rank(config, s) for s in (1, 2, 4, 8)] == [8, 4, 2, 1]


def test_kv_heads_are_split_then_replicated() -> None:
    qwen = ModelConfig.preset("qwen2.5-7b")  # 28 query heads, 4 KV heads
    assert [kv_head_of_rank(qwen, 2, r) for r in range(2)] == [0, 2]
    assert [kv_head_of_rank(qwen, 4, r) for r in range(4)] == [0, 1, 2, 3]
    tiny = ModelConfig.preset("tiny")  # 4 query heads, 2 KV heads
    assert kv_heads_per_rank(tiny, 4) == 1
    assert [kv_head_of_rank(tiny, 4, r) for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("preset", "size", "message"),
    [
        ("qwen2.5-7b", 8, "num_attention_heads 28 is not divisible by tensor_parallel_size 8"),
        ("llama3-70b", 16, "outside 1..8"),
        ("llama3-70b", 0, "outside 1..8"),
        ("llama3-70b", 3, "num_attention_heads 64 is not divisible"),
    ],
)
def test_bad_degrees_name_the_shape(preset: str, size: int, message: str) -> None:
    with pytest.raises(TensorParallelError, match=message):
        check_tensor_parallel(ModelConfig.preset(preset), size)


def test_kv_replication_only_in_whole_copies() -> None:
    tiny = ModelConfig.preset("tiny")
    config = dataclasses.replace(
        tiny, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96
    )
    assert tensor_parallel_problem(config, 3) is None
    assert "not divisible" in str(tensor_parallel_problem(config, 2))
    wide = dataclasses.replace(config, num_attention_heads=12)
    assert "multiple of num_key_value_heads 3" in str(tensor_parallel_problem(wide, 4))
    assert tensor_parallel_problem(wide, 6) is None
