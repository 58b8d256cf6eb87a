"""Known architectures with random weights, registrable as base models (`--preset NAME`).

`tiny` runs anywhere (tests, the local demo); the others have the shapes of real models for GPU
benchmarks. The config keys follow Hugging Face's `config.json` names so the runtime can build
the model from either a checkpoint's config or a preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A random-init base model: its architecture, default context length and config."""

    name: str
    architecture: str
    context_length: int
    config: dict[str, Any]


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        architecture="llama",
        context_length=512,
        config={
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 512,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 512,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
    ),
    "llama3-8b": Preset(
        name="llama3-8b",
        architecture="llama",
        context_length=8192,
        config={
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2.5-7b": Preset(
        name="qwen2.5-7b",
        architecture="qwen2",
        context_length=32768,
        config={
            "hidden_size": 3584,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "intermediate_size": 18944,
            "vocab_size": 152064,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "attention_bias": True,  # Qwen2 has biases on the q, k and v projections
            "tie_word_embeddings": False,
        },
    ),
}


def preset_get(name: str) -> Preset:
    """Return the preset called `name`; KeyError lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
