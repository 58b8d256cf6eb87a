"""Which tensor-parallel degrees a model shape allows, and how its heads divide.

One rule for both halves: the control plane refuses a deployment whose `tensor_parallel_size`
the base model cannot be sharded at, and the runtime shards the model by the same numbers
(`gpu_runtime.distributed.shard`). Megatron-style sharding splits query heads, the MLP's
intermediate width and the vocabulary across ranks; key/value heads are split when there are
at least as many as ranks and replicated otherwise (each of `size // kv_heads` ranks holds a
copy of one KV head, as in vLLM and SGLang).
"""

from __future__ import annotations

from gpu_runtime.contract.model_config import ModelConfig

MAX_TENSOR_PARALLEL_SIZE = 8
"""The most GPUs one engine group spans: the GPUs of one NVLink node."""


class TensorParallelError(ValueError):
    """A model cannot be sharded at the asked degree; the message names the shape."""


def tensor_parallel_problem(config: ModelConfig, size: int) -> str | None:
    """Why `config` cannot run at tensor-parallel degree `size`, or None when it can."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        return f"tensor_parallel_size {size} is outside 1..{MAX_TENSOR_PARALLEL_SIZE}"
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        return f"num_attention_heads {heads} is not divisible by tensor_parallel_size {size}"
    if kv >= size and kv % size:
        return f"num_key_value_heads {kv} is not divisible by tensor_parallel_size {size}"
    if kv < size and size % kv:
        return (
            f"tensor_parallel_size {size} is not a multiple of num_key_value_heads {kv} "
            "(KV heads are replicated only in whole copies)"
        )
    if config.intermediate_size % size:
        return (
            f"intermediate_size {config.intermediate_size} is not divisible by "
            f"tensor_parallel_size {size}"
        )
    return None


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise `TensorParallelError` when `config` cannot run at degree `size`."""
    problem = tensor_parallel_problem(config, size)
    if problem is not None:
        raise TensorParallelError(problem)


def kv_heads_per_rank(config: ModelConfig, size: int) -> int:
    """Key/value heads each rank holds: `kv // size`, or 1 (a replica) when `size > kv`."""
    check_tensor_parallel(config, size)
    return max(config.num_key_value_heads // size, 1)


def kv_head_of_rank(config: ModelConfig, size: int, rank: int) -> int:
    """The first global KV head rank `rank` holds (its `kv_heads_per_rank` heads follow)."""
    check_tensor_parallel(config, size)
    kv = config.num_key_value_heads
    if size <= kv:
        return rank * (kv // size)
    return rank // (size // kv)
