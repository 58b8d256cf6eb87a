"""Parsing of a job's training settings: OpenAI's hyperparameters and our LoRA options.

Hyperparameters come either at the top level (`hyperparameters`, OpenAI's older shape) or in
`method = {"type": "supervised", "supervised": {"hyperparameters": {...}}}`. Each of `n_epochs`,
`batch_size` and `learning_rate_multiplier` is a number in range or "auto" (the default).
A DPO job gives `method = {"type": "dpo", "dpo": {"hyperparameters": {...}}}` with the same
three plus `beta` (a number in `BETA_RANGE`, or "auto": 0.1 on the host); a top-level
`hyperparameters` object then cannot also be given.
Ranges and LoRA defaults are the contract's (`gpu_runtime.contract.hparams`).
LoRA options come in an extension object `lora = {"rank", "alpha", "dropout", "target_modules"}`.
`metadata` is OpenAI's: at most 16 string pairs, keys up to 64 characters, values up to 512.
`integrations` (OpenAI's Weights & Biases reporting) is refused: this server has no wandb package
and no network to reach it, and a setting it would not honour must not be accepted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from api.errors import HarliError
from gpu_runtime.contract.hparams import (
    ALL_LINEAR,
    AUTO,
    BATCH_SIZE_RANGE,
    BETA_RANGE,
    DEFAULT_LORA_ALPHA,
    DEFAULT_LORA_DROPOUT,
    DEFAULT_LORA_MAX_RANK,
    DEFAULT_LORA_RANK,
    DEFAULT_LORA_TARGET_MODULES,
    LEARNING_RATE_MULTIPLIER_RANGE,
    LORA_ALPHA_RANGE,
    N_EPOCHS_RANGE,
    HyperparameterError,
    resolve_target_modules,
)

LORA_RANK_RANGE = (1, DEFAULT_LORA_MAX_RANK)
"""Ranks the hosts' adapter slots hold: a larger adapter could be trained but never served."""
SUFFIX_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MODULE_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")
SEED_RANGE = (0, 2**31 - 1)
SUPERVISED = "supervised"
DPO = "dpo"
METADATA_MAX_PAIRS = 16
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512


def _invalid(param: str, message: str) -> HarliError:
    return HarliError(message, param=param, code="invalid_hyperparameters")


def _finite(value: int | float) -> bool:
    """A number a JSON column holds and float() can take (no inf, nan or int past float)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _int_or_auto(value: Any, *, param: str, bounds: tuple[int, int]) -> int | str:
    if value is None or value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(param, f"{param} must be an integer or 'auto', got {value!r}.")
    low, high = bounds
    if not low <= value <= high:
        raise _invalid(param, f"{param} must be between {low} and {high}, got {value}.")
    return value


def _float_or_auto(value: Any, *, param: str, bounds: tuple[float, float]) -> float | str:
    if value is None or value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(param, f"{param} must be a number or 'auto', got {value!r}.")
    low, high = bounds
    if not _finite(value) or not low <= float(value) <= high:
        raise _invalid(param, f"{param} must be between {low} and {high}, got {value}.")
    return float(value)


def parse_hyperparameters(hyperparameters: Any, method: Any) -> dict[str, int | float | str]:
    """Return `{"n_epochs", "batch_size", "learning_rate_multiplier"}` with "auto" defaults."""
    if method is not None:
        if not isinstance(method, dict):
            raise HarliError("method must be an object.", param="method")
        if method.get("type") != SUPERVISED:
            raise HarliError(
                f"Method type must be 'supervised' or 'dpo', got {method.get('type')!r}.",
                param="method.type",
                code="unsupported_method",
            )
        supervised = method.get("supervised") or {}
        if not isinstance(supervised, dict):
            raise HarliError("method.supervised must be an object.", param="method.supervised")
        from_method = supervised.get("hyperparameters")
        if from_method is not None and hyperparameters is not None:
            raise HarliError(
                "Give hyperparameters either at the top level or in method, not both.",
                param="hyperparameters",
            )
        hyperparameters = from_method if from_method is not None else hyperparameters
    hyperparameters = hyperparameters or {}
    if not isinstance(hyperparameters, dict):
        raise _invalid("hyperparameters", "hyperparameters must be an object.")
    known = {"n_epochs", "batch_size", "learning_rate_multiplier"}
    unknown = sorted(set(hyperparameters) - known)
    if unknown:
        raise _invalid(
            f"hyperparameters.{unknown[0]}", f"Unknown hyperparameter(s): {', '.join(unknown)}."
        )
    return {
        "n_epochs": _int_or_auto(
            hyperparameters.get("n_epochs"), param="n_epochs", bounds=N_EPOCHS_RANGE
        ),
        "batch_size": _int_or_auto(
            hyperparameters.get("batch_size"), param="batch_size", bounds=BATCH_SIZE_RANGE
        ),
        "learning_rate_multiplier": _float_or_auto(
            hyperparameters.get("learning_rate_multiplier"),
            param="learning_rate_multiplier",
            bounds=LEARNING_RATE_MULTIPLIER_RANGE,
        ),
    }


@dataclass(frozen=True)
class TrainingMethod:
    """A job's method: its type, OpenAI's three hyperparameters and, for DPO, beta."""

    type: str
    hyperparameters: dict[str, int | float | str]
    beta: float | str | None = None
    """A number or "auto" for DPO; None for supervised."""


def _beta(value: Any) -> float | str:
    if value is None or value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid("beta", f"beta must be a number or 'auto', got {value!r}.")
    low, high = BETA_RANGE
    if not _finite(value) or not low < float(value) <= high:
        raise _invalid("beta", f"beta must be greater than {low} and at most {high}, got {value}.")
    return float(value)


def parse_method(hyperparameters: Any, method: Any) -> TrainingMethod:
    """The job's method (supervised unless `method.type` is "dpo"); see the module docstring."""
    if not isinstance(method, dict) or method.get("type") != DPO:
        return TrainingMethod(SUPERVISED, parse_hyperparameters(hyperparameters, method))
    dpo = method.get("dpo") or {}
    if not isinstance(dpo, dict):
        raise HarliError("method.dpo must be an object.", param="method.dpo")
    unknown = sorted(set(method) - {"type", "dpo"})
    if unknown:
        raise HarliError(f"Unknown method field(s): {', '.join(unknown)}.", param="method")
    if hyperparameters is not None:
        raise HarliError(
            "Give a DPO job's hyperparameters in method.dpo.hyperparameters.",
            param="hyperparameters",
        )
    given = dpo.get("hyperparameters") or {}
    if not isinstance(given, dict):
        raise _invalid("hyperparameters", "method.dpo.hyperparameters must be an object.")
    rest = {k: v for k, v in given.items() if k != "beta"}
    return TrainingMethod(DPO, parse_hyperparameters(rest, None), beta=_beta(given.get("beta")))


@dataclass(frozen=True)
class LoraOptions:
    """A job's LoRA options as given ("all-linear" is kept; the host expands it); defaults
    are the contract's."""

    rank: int = DEFAULT_LORA_RANK
    alpha: float = DEFAULT_LORA_ALPHA
    dropout: float = DEFAULT_LORA_DROPOUT
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES


def parse_lora(lora: Any, *, architecture: str | None = None) -> LoraOptions:
    """Validate the `lora` extension object; missing keys take LoraOptions' defaults.

    `target_modules` must name projections of the base model's `architecture` (or be
    `["all-linear"]`), each once: a name the host could not wrap is refused here, not when
    the job reaches a host."""
    if lora is None:
        return LoraOptions()
    if not isinstance(lora, dict):
        raise _invalid("lora", "lora must be an object.")
    unknown = sorted(set(lora) - {"rank", "alpha", "dropout", "target_modules"})
    if unknown:
        raise _invalid(f"lora.{unknown[0]}", f"Unknown LoRA option(s): {', '.join(unknown)}.")
    defaults = LoraOptions()
    rank = lora.get("rank", defaults.rank)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise _invalid("lora.rank", f"lora.rank must be an integer, got {rank!r}.")
    if not LORA_RANK_RANGE[0] <= rank <= LORA_RANK_RANGE[1]:
        low, high = LORA_RANK_RANGE
        raise _invalid(
            "lora.rank",
            f"lora.rank must be between {low} and {high} (the largest rank hosts serve), "
            f"got {rank}.",
        )
    alpha = lora.get("alpha", defaults.alpha)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _invalid("lora.alpha", f"lora.alpha must be a number, got {alpha!r}.")
    alpha_low, alpha_high = LORA_ALPHA_RANGE
    if not _finite(alpha) or not alpha_low < float(alpha) <= alpha_high:
        raise _invalid(
            "lora.alpha",
            f"lora.alpha must be greater than {alpha_low} and at most {alpha_high}, got {alpha!r}.",
        )
    dropout = lora.get("dropout", defaults.dropout)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise _invalid("lora.dropout", f"lora.dropout must be a number, got {dropout!r}.")
    if not _finite(dropout) or not 0.0 <= dropout < 1.0:
        raise _invalid("lora.dropout", f"lora.dropout must be in [0, 1), got {dropout}.")
    modules = lora.get("target_modules", list(defaults.target_modules))
    if (
        not isinstance(modules, list)
        or not modules
        or not all(
            isinstance(m, str) and (m == ALL_LINEAR or MODULE_PATTERN.match(m)) for m in modules
        )
    ):
        raise _invalid(
            "lora.target_modules",
            f"lora.target_modules must be a non-empty list of module names, got {modules!r}.",
        )
    try:
        resolve_target_modules(modules, architecture=architecture)
    except HyperparameterError as exc:
        raise _invalid("lora.target_modules", f"lora.{exc}.") from None
    return LoraOptions(
        rank=rank, alpha=float(alpha), dropout=float(dropout), target_modules=tuple(modules)
    )


def parse_suffix(suffix: Any) -> str:
    if suffix is None or suffix == "":
        return ""
    if not isinstance(suffix, str) or not SUFFIX_PATTERN.match(suffix):
        raise HarliError(
            f"suffix must be 1-64 of A-Z, a-z, 0-9, '_' and '-', got {suffix!r}.", param="suffix"
        )
    return suffix


def parse_seed(seed: Any) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise HarliError(f"seed must be an integer, got {seed!r}.", param="seed")
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise HarliError(f"seed must be between 0 and {SEED_RANGE[1]}, got {seed}.", param="seed")
    return seed


def parse_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's metadata: null, or at most 16 string keys (1-64 chars) to strings (<= 512)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HarliError("metadata must map strings to strings.", param="metadata")
    if len(metadata) > METADATA_MAX_PAIRS:
        raise HarliError(
            f"metadata holds at most {METADATA_MAX_PAIRS} pairs, got {len(metadata)}.",
            param="metadata",
        )
    for key, value in metadata.items():
        if not 1 <= len(key) <= METADATA_KEY_MAX:
            raise HarliError(
                f"metadata keys are 1-{METADATA_KEY_MAX} characters, got {key!r}.",
                param="metadata",
            )
        if len(value) > METADATA_VALUE_MAX:
            raise HarliError(
                f"metadata[{key!r}] is longer than {METADATA_VALUE_MAX} characters.",
                param="metadata",
            )
    return dict(metadata)


def parse_integrations(integrations: Any) -> None:
    """Refuse any integration (see the module docstring); null or [] asks for none."""
    if integrations is None or integrations == []:
        return
    kinds = (
        sorted({str(i.get("type")) for i in integrations if isinstance(i, dict)})
        if isinstance(integrations, list)
        else []
    )
    named = f" ({', '.join(kinds)})" if kinds else ""
    raise HarliError(
        f"integrations{named} are not supported on this server: the wandb package is not "
        "installed and no integration can be reached. Omit 'integrations'.",
        param="integrations",
        code="unsupported_integration",
    )
