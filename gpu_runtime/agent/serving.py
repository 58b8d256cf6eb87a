"""The host's one serving engine per base model: weights, KV cache and the LoRA runtime that
serves every finished adapter by name in the same batches as base-model requests."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.finetune.lora_serving import MultiLoraRuntime
from gpu_runtime.model.loader import load_model, load_tokenizer


@dataclass(frozen=True)
class EngineSpec:
    """How this host builds its engine for a model directory (also when it loads another base
    model). `config.max_model_len` is capped by the model's position embeddings."""

    config: EngineConfig
    """Engine settings; `max_model_len` is the cap the host asks for."""
    dtype: str | None = None
    """Weights dtype (None: the checkpoint's)."""
    lora_slots: int = 8
    """Adapters resident on the device at once (more are served, swapped in LRU order)."""
    lora_max_rank: int = 64
    """Largest adapter rank the slots hold; a request for a larger one is refused (HTTP 400)."""

    def __post_init__(self) -> None:
        if self.lora_slots < 1 or self.lora_max_rank < 1:
            raise ValueError(
                f"lora_slots and lora_max_rank must be >= 1, got {self.lora_slots}, "
                f"{self.lora_max_rank}"
            )

    def build(self, model_dir: Path) -> Engine:
        """Load `model_dir` and return its engine, with a `MultiLoraRuntime` as `engine.lora`
        over the same model object (the finetune trees of this host share its weights too)."""
        model = load_model(model_dir, device=self.config.device, dtype=self.dtype)
        config = replace(
            self.config,
            max_model_len=min(self.config.max_model_len, model.config.max_position_embeddings),
        )
        lora = MultiLoraRuntime(
            model,
            max_tokens=config.max_num_batched_tokens,
            num_slots=self.lora_slots,
            max_rank=self.lora_max_rank,
        )
        return Engine(model, config, tokenizer=load_tokenizer(model_dir), lora=lora)


def lora_runtime(engine: Engine) -> MultiLoraRuntime:
    """The engine's LoRA runtime (engines built by :class:`EngineSpec` always have one)."""
    lora = engine.lora
    if not isinstance(lora, MultiLoraRuntime):
        raise TypeError(f"the host engine needs a MultiLoraRuntime, got {type(lora).__name__}")
    return lora
