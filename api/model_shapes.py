"""A base model's shape as the control plane sees it: its stored `config` (presets), or the
`config.json` of its checkpoint directory. Registration reads architecture and context length
from it, deployment creation the tensor-parallel degrees the shape allows."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from api.errors import HarliError
from api.models import BaseModel
from gpu_runtime.contract.model_config import ModelConfig, ModelConfigError


def checkpoint_hf_config(directory: Path) -> dict[str, Any] | None:
    """`directory/config.json` as a dict; None when there is none. An unreadable or non-object
    file is a HarliError naming it (param `checkpoint_dir`)."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise HarliError(f"Cannot read {config_path}: {exc}", param="checkpoint_dir") from None
    if not isinstance(config, dict):
        raise HarliError(f"{config_path} is not a JSON object.", param="checkpoint_dir")
    return config


def base_model_shape(base_model: BaseModel) -> ModelConfig | None:
    """The base model's `ModelConfig`: from its `config`, else its checkpoint's config.json;
    None when neither gives one (no config.json, or one that is not a known architecture's)."""
    hf = base_model.config or (
        checkpoint_hf_config(Path(base_model.checkpoint_dir)) if base_model.checkpoint_dir else None
    )
    if not hf:
        return None
    try:
        return ModelConfig.from_hf_config(hf)
    except (ModelConfigError, KeyError, TypeError, ValueError):
        return None


ARCHITECTURE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What a base model's `architecture` may be: a model type name."""


def config_architecture(config: dict[str, Any]) -> str | None:
    """The config's `model_type` ("mistral"), else its `architectures[0]` less the
    "ForCausalLM" suffix, lowercased ("MistralForCausalLM" -> "mistral"); None: neither."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        return model_type
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str) and names[0]:
        return names[0].removesuffix("ForCausalLM").lower() or None
    return None


def checkpoint_architecture(directory: Path) -> tuple[str | None, int | None]:
    """Architecture (:func:`config_architecture`) and context length from
    `directory/config.json`, where present."""
    config = checkpoint_hf_config(directory)
    if config is None:
        return None, None
    context = config.get("max_position_embeddings")
    return config_architecture(config), context if isinstance(context, int) else None
