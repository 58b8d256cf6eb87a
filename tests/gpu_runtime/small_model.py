"""The small model the GPU tests share: 4 layers, hidden 512, GQA 8/2 heads of 64, 1,000 tokens;
bf16 random weights (seed 4) on CUDA."""

from __future__ import annotations

from gpu_runtime.model import CausalLM, ModelConfig, build_random_model
from gpu_runtime.model.tiny import tiny_config


def small_config(architecture: str = "llama") -> ModelConfig:
    """The shape, for `architecture` ("llama" or "qwen2")."""
    return tiny_config(
        architecture,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
    )


def small_cuda_model(architecture: str = "llama") -> CausalLM:
    """Random bf16 weights (seed 4) of `small_config(architecture)` on CUDA."""
    return build_random_model(small_config(architecture), seed=4, device="cuda", dtype="bfloat16")
