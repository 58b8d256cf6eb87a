"""The memory a LoRA job borrows on its host: adapter state plus one micro-batch of activations.

One estimate for both halves: placement charges it against a host's free memory before it
sends a job there, and the host counts its jobs' adapter state with the same per-parameter
bytes.

* Adapter parameters: per layer, rank x (in + out features) of each targeted projection
  (:func:`projection_shapes`; "all-linear" targets every one).
* Adapter state: :data:`ADAPTER_STATE_BYTES_PER_PARAM` bytes per parameter (fp32 weight,
  gradient and the two AdamW moments).
* Activations: :data:`ACTIVATION_BYTES_PER_UNIT` bytes per (token x hidden unit x layer) of
  LoRA training without recomputation.
* A job is charged at least :data:`MIN_FINETUNE_BYTES`.

Under tensor parallelism of degree t the figures are per GPU (every rank holds the same share),
sharded as the base weights are (Megatron-style, as S-LoRA / vLLM shard LoRA):

* column-parallel projections (q/k/v, gate/up): LoRA A (in x r) is replicated, B (r x out)
  split, so a rank holds r x (in + out / t); k/v count the KV heads a rank holds (whole
  replicas when t exceeds the KV-head count, `tensor_parallel.kv_heads_per_rank`);
* row-parallel projections (o, down): A (in x r) split, B (r x out) replicated:
  r x (in / t + out);
* activations: divided by t (the attention and MLP intermediates that dominate are sharded);
* the minimum charge is per GPU.

At t = 1 every figure equals the unsharded one. A degree the shape does not allow is a
`TensorParallelError`.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.tensor_parallel import check_tensor_parallel, kv_heads_per_rank

MIB = 2**20
ADAPTER_STATE_BYTES_PER_PARAM = 16
"""Adapter weight + gradient + two AdamW moments, fp32."""
ACTIVATION_BYTES_PER_UNIT = 34
"""Activation bytes per (token x hidden unit x layer) of LoRA training without recomputation."""
MIN_FINETUNE_BYTES = 64 * MIB
"""The least a job is charged (also what a model without a known shape is charged)."""
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of one decoder layer that LoRA can target."""


COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
"""Projections whose output features are split across ranks (the rest split their inputs)."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` for every projection of one layer."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    return {
        "q_proj": (h, config.num_attention_heads * d),
        "k_proj": (h, config.num_key_value_heads * d),
        "v_proj": (h, config.num_key_value_heads * d),
        "o_proj": (config.num_attention_heads * d, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def rank_lora_shapes(config: ModelConfig, tensor_parallel_size: int) -> dict[str, tuple[int, int]]:
    """``module -> (A's in_features, B's out_features)`` on one rank at degree
    `tensor_parallel_size` (the module docstring's rule; the full shapes at 1)."""
    t = tensor_parallel_size
    shapes = projection_shapes(config)
    if t == 1:
        return shapes
    check_tensor_parallel(config, t)
    kv_out = kv_heads_per_rank(config, t) * config.head_dim
    rank_shapes = {}
    for name, (fan_in, fan_out) in shapes.items():
        if name in ("k_proj", "v_proj"):
            rank_shapes[name] = (fan_in, kv_out)
        elif name in COLUMN_PARALLEL:
            rank_shapes[name] = (fan_in, fan_out // t)
        else:
            rank_shapes[name] = (fan_in // t, fan_out)
    return rank_shapes


def adapter_parameter_count(
    config: ModelConfig,
    *,
    rank: int,
    target_modules: Sequence[str],
    tensor_parallel_size: int = 1,
) -> int:
    """LoRA parameters of an adapter of `rank` on `target_modules` (["all-linear"]: every
    projection; names that are not projections count nothing), on one GPU of a group of
    `tensor_parallel_size` (the whole adapter at 1)."""
    targets = list(LORA_PROJECTIONS) if list(target_modules) == ["all-linear"] else target_modules
    shapes = rank_lora_shapes(config, tensor_parallel_size)
    per_layer = sum(rank * sum(shapes[t]) for t in targets if t in shapes)
    return config.num_hidden_layers * per_layer


def adapter_state_bytes(parameter_count: int) -> int:
    """Bytes of training state of `parameter_count` adapter parameters."""
    return parameter_count * ADAPTER_STATE_BYTES_PER_PARAM


def activation_bytes(config: ModelConfig, *, tokens: int, tensor_parallel_size: int = 1) -> int:
    """Activation bytes of one micro-batch of `tokens` tokens (per GPU at a degree above 1:
    divided by it, rounded up)."""
    total = tokens * config.hidden_size * config.num_hidden_layers * ACTIVATION_BYTES_PER_UNIT
    return -(-total // tensor_parallel_size)


def finetune_footprint_bytes(
    config: ModelConfig,
    *,
    rank: int,
    target_modules: Sequence[str],
    tokens: int,
    tensor_parallel_size: int = 1,
) -> int:
    """What a job borrows: adapter state plus one micro-batch of `tokens`, at least
    :data:`MIN_FINETUNE_BYTES`; on each GPU of a group of `tensor_parallel_size` (the module
    docstring's rule; the whole job at 1)."""
    parameters = adapter_parameter_count(
        config, rank=rank, target_modules=target_modules, tensor_parallel_size=tensor_parallel_size
    )
    activations = activation_bytes(config, tokens=tokens, tensor_parallel_size=tensor_parallel_size)
    return max(MIN_FINETUNE_BYTES, adapter_state_bytes(parameters) + activations)
