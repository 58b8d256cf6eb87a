"""Known architectures with random weights, registrable as base models (`--preset NAME`).

`tiny` runs anywhere (tests, the local demo); the others have the shapes of real models for GPU
benchmarks. The shapes themselves are the contract's (`ModelConfig.preset`, in
`gpu_runtime.contract.model_config`), so the control plane and the hosts can never disagree on
them; a preset's `config` is that shape as a Hugging Face `config.json` dict, from which the
runtime builds the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_runtime.contract.model_config import ModelConfig


@dataclass(frozen=True)
class Preset:
    """A random-init base model: its architecture, default context length and config."""

    name: str
    architecture: str
    context_length: int
    config: dict[str, Any]


def _preset(name: str, context_length: int) -> Preset:
    shape = ModelConfig.preset(name)
    return Preset(
        name=name,
        architecture=shape.architecture,
        context_length=context_length,
        config=shape.to_hf_config(),
    )


# Default served context per preset (the models' own limits are larger for Llama 3).
PRESETS: dict[str, Preset] = {
    "tiny": _preset("tiny", 512),
    "llama3-8b": _preset("llama3-8b", 8192),
    "qwen2.5-7b": _preset("qwen2.5-7b", 32768),
    "llama3-70b": _preset("llama3-70b", 8192),
    "qwen2.5-72b": _preset("qwen2.5-72b", 32768),
}


def preset_get(name: str) -> Preset:
    """Return the preset called `name`; KeyError lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
