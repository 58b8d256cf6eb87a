"""Which projections a PEFT LoRA adapter adapts, each with its rank and scaling, exactly as
HF + peft computes them, or a refusal naming the field that this server cannot serve.

:func:`adapter_layout` reads an ``adapter_config.json`` (a dict) against the serving model's
shape. Every ``LoraConfig`` field (peft 0.21) is in one of these sets:

* served: ``r``, ``lora_alpha``, ``use_rslora`` (scaling ``alpha / sqrt(r)`` instead of
  ``alpha / r``), ``rank_pattern`` and ``alpha_pattern`` (per-module rank and alpha),
  ``target_modules`` (a list of names or suffixes, a regex string, ``"all-linear"``, or absent:
  peft's default for the architecture), ``exclude_modules``, ``layers_to_transform``,
  ``layers_pattern``. Module keys are the HF model's (``model.layers.3.self_attn.q_proj``);
  targets are matched by peft's own ``check_target_module_exists`` and patterns by its
  ``get_pattern_key``, so a key matches here exactly when it matches in peft;
* no effect on a trained adapter's outputs, accepted: :data:`NO_EFFECT_FIELDS` (dropout is off
  at inference; ``fan_in_fan_out`` is reset by peft for ``nn.Linear``; init-only settings are
  overwritten by the trained tensors) and ``init_lora_weights`` in :data:`SERVED_INITS`;
* refused (:class:`UnsupportedAdapterError`, naming the field and value) when set:
  :data:`REFUSED_WHEN_SET` (DoRA and the other LoRA variants, a bias on ``lora_B``, full
  modules or token rows saved beside the adapter, layer replication, parameter targets,
  Megatron layers), an ``init_lora_weights`` that rewrites the base weights when peft loads the
  adapter (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) or selects a variant (MiCA), a ``peft_type``
  other than ``LORA``, a ``task_type`` other than ``CAUSAL_LM``, targets matching a module that
  is not an attention or MLP projection (``lm_head``, ``embed_tokens``, norms), and any field
  this module does not know set to a non-empty value.

``bias`` other than ``"none"`` is served only when the adapter file holds no bias tensor (the
host adapter checks the tensors; see :mod:`gpu_runtime.lora.host_adapter`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from peft.utils.other import get_pattern_key

from gpu_runtime.contract.hparams import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from gpu_runtime.lora.errors import AdapterConfigError, UnsupportedAdapterError
from gpu_runtime.model import ModelConfig

__all__ = [
    "AdapterConfigError",
    "AdapterLayout",
    "ModuleLora",
    "UnsupportedAdapterError",
    "adapter_layout",
    "module_key",
]

ProjectionKey = tuple[int, str]

SERVED_FIELDS = frozenset(
    {
        "r",
        "lora_alpha",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "bias",
        "init_lora_weights",
        "peft_type",
        "task_type",
    }
)
NO_EFFECT_FIELDS = frozenset(
    {
        "auto_mapping",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "peft_version",
        "lora_dropout",
        "fan_in_fan_out",
        "megatron_core",
        "qalora_group_size",
        "runtime_config",
        "ensure_weight_tying",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
    }
)
"""Fields that do not change a trained adapter's outputs over this server's models."""
REFUSED_WHEN_SET: dict[str, str] = {
    "use_dora": "DoRA (a per-module magnitude vector) is not served; merge it into the base "
    "weights or train a plain LoRA adapter",
    "lora_bias": "a bias on lora_B is not served; train with lora_bias=False",
    "modules_to_save": "fully trained modules saved beside the adapter are not served; train "
    "without modules_to_save",
    "trainable_token_indices": "trained embedding rows are not served",
    "layer_replication": "layer replication changes the model's depth and is not served",
    "target_parameters": "LoRA on parameters (not modules) is not served",
    "megatron_config": "Megatron parallel layers are not served",
    "use_qalora": "QA-LoRA (input pooling) is not served",
    "velora_config": "the VeLoRA variant is not served",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not served",
    "monteclora_config": "the MonteCLoRA variant is not served",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA) is not served",
    "arrow_config": "Arrow routing is not served",
    "kasa_config": "the KaSA variant is not served",
}
"""Fields whose non-empty value changes the computation in a way this server does not serve."""
SERVED_INITS = (True, False, "gaussian", "orthogonal", "eva")
"""``init_lora_weights`` values that only set the initial A and B (the trained tensors replace
them); the others rewrite base weights when peft loads the adapter, or select a variant."""
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
PEFT_DEFAULT_R, PEFT_DEFAULT_ALPHA = 8, 8
"""``LoraConfig``'s defaults, for a config that leaves ``r`` or ``lora_alpha`` out."""
_OFF: tuple[object, ...] = (None, False, "", [], {})


@dataclass(frozen=True)
class ModuleLora:
    """One adapted projection: its rank and the factor peft multiplies ``B @ A`` by."""

    rank: int
    alpha: float
    scaling: float


@dataclass(frozen=True)
class AdapterLayout:
    """Every ``(layer, projection)`` an adapter adapts; projections absent get no term."""

    modules: dict[ProjectionKey, ModuleLora]

    @property
    def max_rank(self) -> int:
        """The slot rank this adapter needs (lower module ranks are zero-padded)."""
        return max(m.rank for m in self.modules.values())

    @property
    def projections(self) -> frozenset[str]:
        """Projection names adapted in at least one layer."""
        return frozenset(module for _, module in self.modules)


def module_key(layer: int, projection: str) -> str:
    """The HF model's module name of ``projection`` in ``layer`` (what peft matches)."""
    parent = "mlp" if projection in MLP_PROJECTIONS else "self_attn"
    return f"model.layers.{layer}.{parent}.{projection}"


def _other_module_keys(config: ModelConfig) -> list[str]:
    """The HF model's module names that are not projections (peft could match them too)."""
    keys = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb"]
    keys.append("lm_head")
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        keys += [prefix, f"{prefix}.self_attn", f"{prefix}.mlp", f"{prefix}.mlp.act_fn"]
        keys += [f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
    return keys


def _check_fields(raw: Mapping[str, Any]) -> None:
    if raw.get("peft_type") != "LORA":
        raise UnsupportedAdapterError(
            f"peft_type={raw.get('peft_type')!r}: only LORA adapters are served"
        )
    if raw.get("task_type") not in (None, "CAUSAL_LM"):
        raise UnsupportedAdapterError(
            f"task_type={raw['task_type']!r}: only CAUSAL_LM adapters are served"
        )
    for field, reason in REFUSED_WHEN_SET.items():
        if raw.get(field) not in _OFF:
            raise UnsupportedAdapterError(f"{field}={raw[field]!r}: {reason}")
    init = raw.get("init_lora_weights", True)
    if init not in SERVED_INITS:
        raise UnsupportedAdapterError(
            f"init_lora_weights={init!r}: peft rewrites the base weights (or uses a LoRA "
            f"variant) when it loads such an adapter, which is not served; convert it to plain "
            f"LoRA (save_pretrained with path_initial_model_for_weight_conversion)"
        )
    if raw.get("bias", "none") not in ("none", "all", "lora_only"):
        raise AdapterConfigError(f"bias={raw['bias']!r} is not one of 'none', 'all', 'lora_only'")
    unknown = sorted(
        k
        for k in set(raw) - SERVED_FIELDS - NO_EFFECT_FIELDS - set(REFUSED_WHEN_SET)
        if raw[k] not in _OFF
    )
    if unknown:
        raise UnsupportedAdapterError(
            f"adapter_config.json sets {', '.join(f'{k}={raw[k]!r}' for k in unknown)}: fields "
            f"this server does not know are refused when set"
        )


def _targets(raw: Mapping[str, Any], config: ModelConfig) -> SimpleNamespace:
    """The fields peft's target matching reads, normalised as ``LoraConfig`` does."""
    targets = raw.get("target_modules")
    if targets is None:
        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(config.architecture)
        if targets is None:
            raise AdapterConfigError(
                f"target_modules is null and {config.architecture} has no default"
            )
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(PROJECTIONS)  # every nn.Linear but the output layer
    if not isinstance(targets, (str, list)):
        raise AdapterConfigError(f"target_modules={targets!r} is neither a list nor a regex")
    layers = raw.get("layers_to_transform")
    if isinstance(targets, str) and (layers is not None or raw.get("layers_pattern") is not None):
        raise AdapterConfigError(
            f"layers_to_transform={layers!r} / layers_pattern={raw.get('layers_pattern')!r} "
            f"need target_modules as a list, got the regex {targets!r}"
        )
    exclude = raw.get("exclude_modules")
    return SimpleNamespace(
        target_modules=set(targets) if isinstance(targets, list) else targets,
        exclude_modules=set(exclude) if isinstance(exclude, list) else exclude,
        modules_to_save=None,  # refused when set (`_check_fields`)
        target_parameters=None,
        layers_to_transform=layers,
        layers_pattern=raw.get("layers_pattern"),
    )


def _number(field: str, value: Any, *, integer: bool) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise AdapterConfigError(f"{field}={value!r} must be {kind}")
    return float(value)


def _pattern(raw: Mapping[str, Any], field: str) -> dict[str, Any]:
    pattern = raw.get(field) or {}
    if not isinstance(pattern, dict):
        raise AdapterConfigError(f"{field}={pattern!r} must be an object of pattern: value")
    return pattern


def adapter_layout(raw: Mapping[str, Any], config: ModelConfig) -> AdapterLayout:
    """The adapted projections of ``config``'s model, with peft's rank and scaling each (see the
    module docstring); :class:`UnsupportedAdapterError` for an option that is not served."""
    _check_fields(raw)
    match = _targets(raw, config)
    r = int(_number("r", raw.get("r", PEFT_DEFAULT_R), integer=True))
    alpha = _number("lora_alpha", raw.get("lora_alpha", PEFT_DEFAULT_ALPHA), integer=False)
    rank_pattern, alpha_pattern = _pattern(raw, "rank_pattern"), _pattern(raw, "alpha_pattern")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterConfigError(f"use_rslora={rslora!r} must be true or false")
    for key in _other_module_keys(config):
        if check_target_module_exists(match, key):
            raise UnsupportedAdapterError(
                f"target_modules={raw.get('target_modules')!r} matches {key}: only the attention "
                f"and MLP projections {list(PROJECTIONS)} are served"
            )
    modules: dict[ProjectionKey, ModuleLora] = {}
    for layer in range(config.num_hidden_layers):
        for projection in PROJECTIONS:
            key = module_key(layer, projection)
            if not check_target_module_exists(match, key):
                continue
            rank, module_alpha = r, alpha
            r_key = get_pattern_key(list(rank_pattern), key)
            if r_key in rank_pattern:
                field = f"rank_pattern[{r_key!r}]"
                rank = int(_number(field, rank_pattern[r_key], integer=True))
            a_key = get_pattern_key(list(alpha_pattern), key)
            if a_key in alpha_pattern:
                field = f"alpha_pattern[{a_key!r}]"
                module_alpha = _number(field, alpha_pattern[a_key], integer=False)
            scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
            modules[(layer, projection)] = ModuleLora(rank, module_alpha, scaling)
    if not modules:
        raise AdapterConfigError(
            f"target_modules={raw.get('target_modules')!r} (layers_to_transform="
            f"{raw.get('layers_to_transform')!r}) matches no projection of the model"
        )
    return AdapterLayout(modules)
