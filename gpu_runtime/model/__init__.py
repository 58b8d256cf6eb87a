"""Llama-family model (Llama 3, Qwen2/2.5): config, module tree with HF names, loading."""

from gpu_runtime.contract.model_config import ModelConfig, ModelConfigError
from gpu_runtime.model.llama import AttentionFn, CausalLM, DenseCausalAttention
from gpu_runtime.model.loader import (
    ModelLoadError,
    build_random_model,
    load_config,
    load_model,
    load_tokenizer,
    save_model,
    torch_dtype,
)

__all__ = [
    "AttentionFn",
    "CausalLM",
    "DenseCausalAttention",
    "ModelConfig",
    "ModelConfigError",
    "ModelLoadError",
    "build_random_model",
    "load_config",
    "load_model",
    "load_tokenizer",
    "save_model",
    "torch_dtype",
]
