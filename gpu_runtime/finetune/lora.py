"""LoRA on the serving model's own base weights.

:func:`build_training_model` makes a second module tree (a :class:`CausalLM` built on the meta
device) whose every base parameter is a new, frozen ``nn.Parameter`` over the *same storage* as
the serving model's (same ``data_ptr()``; no copy), then injects ``peft`` LoRA layers into that
tree only. The serving model object is never wrapped or modified, so decode requests without an
adapter run exactly the code and weights they ran before. Training never writes base weights:
they have ``requires_grad=False`` and the optimizer only sees adapter parameters.

Adapter parameters are fp32 (master weights for AdamW) whatever the base dtype; on GPU the
trainer runs under bf16 autocast. ``lora_B`` starts at zero (peft's default init), so step 0
computes exactly the base model.

Under tensor parallelism the serving model is one rank's shard: the tree is built with the
serving model's ``parallel.for_finetune()`` (its layers' collectives run on the finetune
communicator, never decode's) and the serving ``shard``, so peft's layers get the rank's
shapes: ``lora_B`` of a column-parallel projection has the rank's rows, ``lora_A`` of a
row-parallel one its columns (:mod:`gpu_runtime.distributed.shard`). Their initial values are
the rank's slice of what one GPU draws with the same seed: the whole adapter is drawn once
over a storage-free skeleton of the whole model and each rank keeps its slice.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from torch import nn

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.model import CausalLM

ADAPTER_NAME = "default"
PEFT_KEY_PREFIX = "base_model.model."


class SharedWeightsError(RuntimeError):
    """The training tree does not share a base tensor with the serving model."""


def lora_config(spec: LoraSpec, base_model_name_or_path: str | None = None) -> LoraConfig:
    """The peft config for ``spec`` (what ``adapter_config.json`` holds)."""
    return LoraConfig(
        r=spec.rank,
        lora_alpha=cast(Any, spec.alpha),  # peft annotates int; a float scales the same
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )


def share_base_weights(serving: CausalLM) -> CausalLM:
    """A fresh ``CausalLM`` tree whose parameters and buffers alias ``serving``'s (frozen); on
    a tensor-parallel rank its collectives run on the finetune communicator."""
    with torch.device("meta"):
        tree = CausalLM(serving.config, parallel=serving.parallel.for_finetune())
    shared: dict[int, nn.Parameter] = {}
    for name, param in serving.named_parameters(remove_duplicate=False):
        # One new Parameter per serving tensor keeps tied embeddings tied.
        frozen = shared.setdefault(id(param), nn.Parameter(param.detach(), requires_grad=False))
        module_name, _, attr = name.rpartition(".")
        setattr(tree.get_submodule(module_name), attr, frozen)
    for name, buffer in serving.named_buffers(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        setattr(tree.get_submodule(module_name), attr, buffer)
    return tree


def build_training_model(serving: CausalLM, spec: LoraSpec, seed: int) -> CausalLM:
    """A LoRA training tree over ``serving``'s base tensors (see the module docstring).

    ``seed`` fixes the adapters' initialisation (``lora_A`` Kaiming-uniform, ``lora_B`` zero)
    without touching the process's global random state.
    """
    tree = share_base_weights(serving)
    # manual_seed seeds every CUDA device: fork (and restore) all of them
    devices = list(range(torch.cuda.device_count())) if serving.lm_head.weight.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        inject_adapter_in_model(lora_config(spec), tree, adapter_name=ADAPTER_NAME)
    if serving.parallel.size > 1:
        whole = _one_gpu_initial_adapter(serving, spec, seed)
        with torch.no_grad():
            for name, param in tree.named_parameters():
                if ".lora_" in name:
                    param.data = serving.shard.take(name, whole[name]).to(param.device).clone()
    for name, param in tree.named_parameters():
        is_adapter = ".lora_" in name
        param.requires_grad_(is_adapter)
        if is_adapter and param.dtype != torch.float32:
            param.data = param.data.float()
    tree.train()
    check_shared_weights(serving, tree)
    return tree


def _one_gpu_initial_adapter(
    serving: CausalLM, spec: LoraSpec, seed: int
) -> dict[str, torch.Tensor]:
    """The adapter one GPU initialises with ``seed`` (live peft names -> whole tensors, CPU):
    peft's own injection, with the same draws in the same order, over a skeleton of the whole
    model whose base weights are stride-0 zeros of the serving dtype (no storage)."""
    with torch.device("meta"):
        skeleton = CausalLM(serving.config)
    dtype = serving.lm_head.weight.dtype
    for name, param in list(skeleton.named_parameters(remove_duplicate=False)):
        module_name, _, attr = name.rpartition(".")
        empty = torch.zeros((), dtype=dtype).expand(param.shape)
        setattr(skeleton.get_submodule(module_name), attr, nn.Parameter(empty, requires_grad=False))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(lora_config(spec), skeleton, adapter_name=ADAPTER_NAME)
    return {name: param.detach() for name, param in skeleton.named_parameters() if ".lora_" in name}


def base_parameter_name(training_name: str) -> str:
    """``...q_proj.base_layer.weight`` (peft's wrapped name) -> ``...q_proj.weight``."""
    return training_name.replace(".base_layer.", ".")


def check_shared_weights(serving: CausalLM, tree: nn.Module) -> None:
    """Raise unless every base parameter of ``tree`` aliases the serving tensor of that name."""
    serving_params = dict(serving.named_parameters(remove_duplicate=False))
    for name, param in tree.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        original = serving_params.get(base_parameter_name(name))
        if original is None:
            raise SharedWeightsError(f"{name} has no counterpart in the serving model")
        if param.data_ptr() != original.data_ptr() or param.shape != original.shape:
            raise SharedWeightsError(f"{name} does not share storage with the serving model")
        if param.requires_grad:
            raise SharedWeightsError(f"{name} is a base weight but requires grad")


def adapter_parameters(tree: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA parameters, in a stable (module) order."""
    return [p for name, p in tree.named_parameters() if ".lora_" in name]


def adapter_parameter_names(tree: nn.Module) -> list[str]:
    """The live names of :func:`adapter_parameters`, in the same order."""
    return [name for name, _ in tree.named_parameters() if ".lora_" in name]


def adapter_state_dict(tree: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights under PEFT's file keys (``base_model.model.<module>.lora_A.weight``)."""
    state = get_peft_model_state_dict(tree, adapter_name=ADAPTER_NAME)
    return {PEFT_KEY_PREFIX + k: v.detach() for k, v in state.items()}
