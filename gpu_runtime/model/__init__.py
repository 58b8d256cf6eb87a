"""Llama-family model (Llama 3, Qwen2/2.5): config, module tree with HF names, the one decoder
definition over pluggable ops (`decoder`), loading."""

from gpu_runtime.contract.model_config import ModelConfig, ModelConfigError
from gpu_runtime.model.attention import AttentionFn, DenseCausalAttention
from gpu_runtime.model.decoder import DecoderOps, DecoderStack
from gpu_runtime.model.llama import CausalLM
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
    "DecoderOps",
    "DecoderStack",
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
