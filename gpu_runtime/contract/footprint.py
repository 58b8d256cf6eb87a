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
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_runtime.contract.model_config import ModelConfig

MIB = 2**20
ADAPTER_STATE_BYTES_PER_PARAM = 16
"""Adapter weight + gradient + two AdamW moments, fp32."""
ACTIVATION_BYTES_PER_UNIT = 34
"""Activation bytes per (token x hidden unit x layer) of LoRA training without recomputation."""
MIN_FINETUNE_BYTES = 64 * MIB
"""The least a job is charged (also what a model without a known shape is charged)."""
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of one decoder layer that LoRA can target."""


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


def adapter_parameter_count(
    config: ModelConfig, *, rank: int, target_modules: Sequence[str]
) -> int:
    """LoRA parameters of an adapter of `rank` on `target_modules` (["all-linear"]: every
    projection; names that are not projections count nothing)."""
    targets = list(LORA_PROJECTIONS) if list(target_modules) == ["all-linear"] else target_modules
    shapes = projection_shapes(config)
    per_layer = sum(rank * sum(shapes[t]) for t in targets if t in shapes)
    return config.num_hidden_layers * per_layer


def adapter_state_bytes(parameter_count: int) -> int:
    """Bytes of training state of `parameter_count` adapter parameters."""
    return parameter_count * ADAPTER_STATE_BYTES_PER_PARAM


def activation_bytes(config: ModelConfig, *, tokens: int) -> int:
    """Activation bytes of one micro-batch of `tokens` tokens."""
    return tokens * config.hidden_size * config.num_hidden_layers * ACTIVATION_BYTES_PER_UNIT


def finetune_footprint_bytes(
    config: ModelConfig, *, rank: int, target_modules: Sequence[str], tokens: int
) -> int:
    """What a job borrows: adapter state plus one micro-batch of `tokens`, at least
    :data:`MIN_FINETUNE_BYTES`."""
    parameters = adapter_parameter_count(config, rank=rank, target_modules=target_modules)
    return max(
        MIN_FINETUNE_BYTES,
        adapter_state_bytes(parameters) + activation_bytes(config, tokens=tokens),
    )
