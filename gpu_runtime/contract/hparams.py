"""A finetune job's settings as the runtime uses them, with "auto" resolved.

They mirror the control plane's job: OpenAI's ``n_epochs``, ``batch_size`` (examples per
optimizer step) and ``learning_rate_multiplier``, each a number or ``"auto"``, plus the LoRA
options ``rank``, ``alpha``, ``dropout``, ``target_modules`` and the job's ``seed``.

"auto" resolves, for a training file of ``n`` usable examples, to:

* ``n_epochs = clamp(ceil(300 / n), 3, 10)`` — small files get more passes;
* ``batch_size = clamp(next_power_of_two(ceil(n / 100)), 1, 32)``;
* ``learning_rate_multiplier = 1.0``; the peak learning rate is
  ``BASE_LEARNING_RATE (2e-4) * learning_rate_multiplier``, a usual LoRA rate;
* a DPO job's ``beta = DEFAULT_DPO_BETA (0.1)`` (:func:`resolve_dpo_beta`).

``target_modules`` may name projections (``q_proj`` ... ``down_proj``) or be the shorthand
``["all-linear"]`` (every projection of attention and MLP, never ``lm_head``).

The ranges and LoRA defaults here are the one definition: the control plane validates a job's
settings against them (`api.hyperparameters`) and the runtime's dataclasses check them again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

AUTO = "auto"
BASE_LEARNING_RATE = 2e-4
DEFAULT_DPO_BETA = 0.1
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"
LORA_MODULES_BY_ARCHITECTURE: dict[str, tuple[str, ...]] = {
    "llama": ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
    "qwen2": ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
}
"""The projections LoRA can wrap in each architecture (`model_config.ARCHITECTURES`), in the
order they are expanded."""
N_EPOCHS_RANGE = (1, 50)
BATCH_SIZE_RANGE = (1, 256)
"""Examples per optimizer step."""
LEARNING_RATE_MULTIPLIER_RANGE = (1e-6, 10.0)
"""What a job may ask for; the runtime only needs it positive."""
BETA_RANGE = (0.0, 2.0)
"""DPO's beta a job may ask for: above the low end (exclusive) and at most the high end."""
LORA_RANK_RANGE = (1, 256)
"""Ranks an adapter may have."""
LORA_ALPHA_RANGE = (0.0, 4096.0)
"""LoRA alpha a job may ask for: above the low end (exclusive) and at most the high end."""
DEFAULT_LORA_MAX_RANK = 64
"""The largest LoRA rank a host serves by default; the control plane refuses jobs above it."""
DEFAULT_LORA_RANK = 16
DEFAULT_LORA_ALPHA = 32.0
DEFAULT_LORA_DROPOUT = 0.05
DEFAULT_LORA_TARGET_MODULES = ATTENTION_PROJECTIONS
LrScheduleKind = Literal["cosine", "linear"]


class HyperparameterError(ValueError):
    """A setting out of range; the message names it and its value."""


def resolve_target_modules(
    target_modules: tuple[str, ...] | list[str], *, architecture: str | None = None
) -> tuple[str, ...]:
    """Expand ``all-linear`` and check every name is a projection LoRA can wrap in
    `architecture` (any architecture's projection when None)."""
    names = tuple(target_modules)
    allowed: tuple[str, ...]
    if architecture is None:
        allowed = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
    elif architecture in LORA_MODULES_BY_ARCHITECTURE:
        allowed = LORA_MODULES_BY_ARCHITECTURE[architecture]
    else:
        raise HyperparameterError(
            f"architecture {architecture!r} not in {sorted(LORA_MODULES_BY_ARCHITECTURE)}"
        )
    if not names:
        raise HyperparameterError("target_modules is empty")
    if ALL_LINEAR in names:
        if len(names) != 1:
            raise HyperparameterError(f"'all-linear' stands alone, got {list(names)}")
        return allowed
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise HyperparameterError(
            f"target_modules {unknown} not in {list(allowed)} (or ['all-linear'])"
        )
    if len(set(names)) != len(names):
        raise HyperparameterError(f"target_modules has duplicates: {list(names)}")
    return tuple(n for n in allowed if n in names)


@dataclass(frozen=True)
class LoraSpec:
    """LoRA shape of one adapter."""

    rank: int = DEFAULT_LORA_RANK
    """Inner dimension r of B @ A (in :data:`LORA_RANK_RANGE`)."""
    alpha: float = DEFAULT_LORA_ALPHA
    """Scale numerator: the adapter adds ``(alpha / rank) * B @ A``."""
    dropout: float = DEFAULT_LORA_DROPOUT
    """Dropout on the adapter's input during training, in [0, 1)."""
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES
    """Projections that get an adapter (``all-linear`` expanded)."""

    def __post_init__(self) -> None:
        low, high = LORA_RANK_RANGE
        if not low <= self.rank <= high:
            raise HyperparameterError(f"rank must be in {low}..{high}, got {self.rank}")
        alpha_low, alpha_high = LORA_ALPHA_RANGE
        if not alpha_low < self.alpha <= alpha_high:  # also refuses NaN
            raise HyperparameterError(
                f"alpha must be greater than {alpha_low} and at most {alpha_high}, got {self.alpha}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise HyperparameterError(f"dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "target_modules", resolve_target_modules(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class FinetuneHyperparameters:
    """All training settings, concrete (no "auto"): what the trainer runs with."""

    n_epochs: int
    """Passes over the training file (in :data:`N_EPOCHS_RANGE`)."""
    batch_size: int
    """Examples per optimizer step (in :data:`BATCH_SIZE_RANGE`); micro-batches accumulate to
    it."""
    learning_rate: float
    """Peak learning rate after warmup."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    """Adapter shape."""
    seed: int = 0
    """Seeds data order, adapter initialisation and dropout."""
    max_seq_len: int = 2048
    """Longer examples are cut on the right."""
    warmup_ratio: float = 0.03
    """Fraction of optimizer steps with linear warmup from 0, in [0, 1)."""
    lr_schedule: LrScheduleKind = "cosine"
    """Decay after warmup down to 0 at the last step."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay on adapter parameters."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradient clipping on the adapter gradients' global L2 norm; 0 disables it."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations: the mode of
    quanta whose call does not choose one (``LoraTrainer.recompute``; a finetune side sizing
    quanta to a memory budget chooses per quantum)."""
    checkpoint_every_steps: int = 0
    """Write a checkpoint every N optimizer steps (0: only when asked and at the end)."""
    dpo_beta: float | None = None
    """DPO's beta (the weight of the policy's divergence from the reference, > 0): the job
    trains on preference pairs (:class:`~gpu_runtime.finetune.dpo_trainer.DpoTrainer`). None:
    supervised training."""

    def __post_init__(self) -> None:
        (epochs_low, epochs_high), (batch_low, batch_high) = N_EPOCHS_RANGE, BATCH_SIZE_RANGE
        checks = [
            (
                epochs_low <= self.n_epochs <= epochs_high,
                f"n_epochs must be in {epochs_low}..{epochs_high}, got {self.n_epochs}",
            ),
            (
                batch_low <= self.batch_size <= batch_high,
                f"batch_size must be in {batch_low}..{batch_high}, got {self.batch_size}",
            ),
            (self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}"),
            (self.max_seq_len >= 2, f"max_seq_len must be >= 2, got {self.max_seq_len}"),
            (
                0 <= self.warmup_ratio < 1,
                f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}",
            ),
            (self.lr_schedule in ("cosine", "linear"), f"lr_schedule {self.lr_schedule!r}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.max_grad_norm >= 0, f"max_grad_norm must be >= 0, got {self.max_grad_norm}"),
            (
                self.checkpoint_every_steps >= 0,
                f"checkpoint_every_steps must be >= 0, got {self.checkpoint_every_steps}",
            ),
            (
                self.dpo_beta is None or self.dpo_beta > 0,
                f"dpo_beta must be > 0, got {self.dpo_beta}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise HyperparameterError(message)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FinetuneHyperparameters:
        values = dict(raw)
        lora = dict(values.pop("lora"))
        lora["target_modules"] = tuple(lora["target_modules"])
        values["adam_betas"] = tuple(values["adam_betas"])
        return cls(lora=LoraSpec(**lora), **values)


def resolve_dpo_beta(beta: float | str = AUTO) -> float:
    """A DPO job's beta: ``DEFAULT_DPO_BETA`` for "auto", else the positive number given."""
    if beta == AUTO:
        return DEFAULT_DPO_BETA
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
        raise HyperparameterError(f"beta must be a positive number or 'auto', got {beta!r}")
    return float(beta)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def resolve_hyperparameters(
    *,
    n_train_examples: int,
    n_epochs: int | str = AUTO,
    batch_size: int | str = AUTO,
    learning_rate_multiplier: float | str = AUTO,
    lora: LoraSpec | None = None,
    seed: int = 0,
    **options: Any,
) -> FinetuneHyperparameters:
    """Resolve a job's OpenAI-style settings (see the module docstring for "auto")."""
    if n_train_examples < 1:
        raise HyperparameterError(f"n_train_examples must be >= 1, got {n_train_examples}")
    n = n_train_examples
    epochs = min(10, max(3, math.ceil(300 / n))) if n_epochs == AUTO else n_epochs
    batch = min(32, _next_power_of_two(math.ceil(n / 100))) if batch_size == AUTO else batch_size
    multiplier = 1.0 if learning_rate_multiplier == AUTO else learning_rate_multiplier
    for name, value in (("n_epochs", epochs), ("batch_size", batch)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise HyperparameterError(f"{name} must be an integer or 'auto', got {value!r}")
    assert isinstance(epochs, int) and isinstance(batch, int)
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or multiplier <= 0:
        raise HyperparameterError(
            f"learning_rate_multiplier must be a positive number or 'auto', got {multiplier!r}"
        )
    return FinetuneHyperparameters(
        n_epochs=epochs,
        batch_size=batch,
        learning_rate=BASE_LEARNING_RATE * float(multiplier),
        lora=lora or LoraSpec(),
        seed=seed,
        **options,
    )
