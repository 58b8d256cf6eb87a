"""A tiny random model and a tiny locally-trained tokenizer, in HF directory format.

Tests and the CPU run command use this instead of downloading anything. The tokenizer
(`gpu_runtime.contract.tiny_tokenizer`, torch-free so the control plane builds the same one) is
a byte-level BPE trained (deterministically) on a small built-in corpus, with ChatML-style
special tokens and a chat template.
"""

from __future__ import annotations

from pathlib import Path

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.tiny_tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB,
    build_tiny_tokenizer,
)
from gpu_runtime.model.loader import build_random_model, save_model

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB",
    "build_tiny_model_dir",
    "build_tiny_tokenizer",
    "tiny_config",
]


def tiny_config(architecture: str = "llama", **overrides: object) -> ModelConfig:
    """The tiny preset for `architecture` ("llama" or "qwen2"), with overrides."""
    base = ModelConfig.preset("tiny")
    if architecture == "qwen2":
        base = base.replace(architecture="qwen2", attention_bias=True, tie_word_embeddings=True)
    elif architecture == "llama":
        base = base.replace(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        )
    return base.replace(**overrides) if overrides else base


def build_tiny_model_dir(
    directory: str | Path,
    architecture: str = "llama",
    seed: int = 0,
    max_shard_bytes: int = 1 << 30,
    **overrides: object,
) -> Path:
    """Write a tiny random model (fp32) plus the tiny tokenizer into `directory`.

    eos is `<|im_end|>`; `max_shard_bytes` small forces several safetensors shards.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_tiny_tokenizer(directory)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    config = tiny_config(architecture, **overrides).replace(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    if config.vocab_size < vocab:
        raise ValueError(f"vocab_size={config.vocab_size} < tokenizer vocabulary {vocab}")
    model = build_random_model(config, seed=seed, device="cpu", dtype="float32")
    save_model(model, directory, max_shard_bytes=max_shard_bytes)
    return directory
