"""Adapters in PEFT format, and whole-trainer checkpoints for exact resume.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as
``peft`` writes them (keys ``base_model.model.<module>.lora_A.weight``), so
``peft.PeftModel.from_pretrained`` loads it over the HF model of the same config.

A checkpoint ``<root>/step-<NNNNNN>/`` is an adapter directory plus ``trainer_state.pt``
(optimizer, schedule position, RNG, data position, loss history, and a DPO trainer's
preference metrics) and ``checkpoint.json``
(hyperparameters and a fingerprint of the training data, checked on resume). It is written to a
temporary directory beside it and renamed into place, so a reader never sees half a checkpoint.
Checkpoints are taken at optimizer-batch boundaries only, where no gradient is pending.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.contract.hparams import FinetuneHyperparameters, LoraSpec
from gpu_runtime.finetune.batching import DataPosition, DataStream
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.lora import ADAPTER_NAME, PEFT_KEY_PREFIX, adapter_state_dict, lora_config
from gpu_runtime.finetune.preference_data import PreferencePair
from gpu_runtime.finetune.quantum import StepRecord, TrainerRng

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINER_STATE = "trainer_state.pt"
CHECKPOINT_META = "checkpoint.json"


class CheckpointError(RuntimeError):
    """A checkpoint or adapter that does not fit the model, data or settings it is loaded into."""


class Progress(Protocol):
    """A trainer's optimizer step count and loss history
    (:class:`~gpu_runtime.finetune.tail.OptimizerTail`)."""

    def restore(self, step: int, history: Sequence[dict[str, float]]) -> None: ...


class CheckpointedTrainer(Protocol):
    """What a whole-trainer checkpoint saves and restores (a supervised or a DPO trainer; a
    trainer with ``preference_history`` also saves it and restores it through
    ``restore_preference_history``)."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def hparams(self) -> FinetuneHyperparameters: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def rng(self) -> TrainerRng: ...

    @property
    def stream(self) -> DataStream: ...

    @property
    def step(self) -> int: ...

    @property
    def history(self) -> list[StepRecord]: ...

    @property
    def total_steps(self) -> int: ...

    @property
    def has_pending_gradients(self) -> bool: ...

    @property
    def optimizer_tail(self) -> Progress: ...


def save_adapter(
    tree: torch.nn.Module,
    spec: LoraSpec,
    directory: str | Path,
    base_model_name_or_path: str | None = None,
) -> None:
    """Write the tree's adapter in PEFT format into ``directory`` (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lora_config(spec, base_model_name_or_path).save_pretrained(str(directory))
    tensors = {k: v.contiguous().cpu() for k, v in adapter_state_dict(tree).items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An adapter's ``adapter_config.json`` (as written, unchecked) and its tensors (PEFT file
    keys), on the CPU. What serving accepts of the config is
    :func:`gpu_runtime.lora.adapter_config.adapter_layout`'s rule."""
    directory = Path(directory)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_path.exists() or not weights_path.exists():
        raise CheckpointError(f"{directory} lacks {ADAPTER_CONFIG} or {ADAPTER_WEIGHTS}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} holds {type(config).__name__}, not an object")
    return config, load_file(str(weights_path))


@torch.no_grad()
def load_adapter_weights(tree: torch.nn.Module, directory: str | Path) -> None:
    """Copy an adapter's tensors into the tree's LoRA parameters; every key must match."""
    _, tensors = read_adapter(directory)
    params = dict(tree.named_parameters())
    expected = set(adapter_state_dict(tree))
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"adapter {directory}: missing keys {missing[:4]} ({len(missing)}), "
            f"unexpected keys {unexpected[:4]} ({len(unexpected)})"
        )
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(PEFT_KEY_PREFIX).rpartition(".lora_")
        name = f"{module}.lora_{kind.removesuffix('.weight')}.{ADAPTER_NAME}.weight"
        param = params[name]
        if param.shape != tensor.shape:
            raise CheckpointError(f"{key}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.copy_(tensor)


def data_fingerprint(examples: Sequence[TokenizedExample | PreferencePair]) -> str:
    """SHA-256 over every example's ids and labels (both rows of a preference pair): resuming
    on other data is refused."""
    digest = hashlib.sha256()
    for example in examples:
        rows = example.rows if isinstance(example, PreferencePair) else (example,)
        for row in rows:
            digest.update(json.dumps([row.input_ids, row.labels]).encode())
    return digest.hexdigest()


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save_checkpoint(
    trainer: CheckpointedTrainer, root: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """Write ``<root>/step-<trainer.step>`` atomically and return its path."""
    if trainer.has_pending_gradients:
        raise CheckpointError("checkpoints are taken between optimizer steps, not mid-batch")
    final = checkpoint_dir(root, trainer.step)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(trainer.model, trainer.hparams.lora, tmp, base_model_name_or_path)
    state = {
        "step": trainer.step,
        "optimizer": trainer.optimizer.state_dict(),
        "rng": trainer.rng.state_dict(),
        "position": trainer.stream.position.to_dict(),
        "history": [vars(record) for record in trainer.history],
    }
    preference = getattr(trainer, "preference_history", None)
    if preference is not None:
        state["preference_history"] = [vars(record) for record in preference]
    torch.save(state, tmp / TRAINER_STATE)
    meta = {
        "step": trainer.step,
        "total_steps": trainer.total_steps,
        "hyperparameters": trainer.hparams.to_dict(),
        "data_fingerprint": data_fingerprint(trainer.stream.examples),
    }
    (tmp / CHECKPOINT_META).write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_checkpoint(trainer: CheckpointedTrainer, path: str | Path) -> None:
    """Restore a fresh trainer (same model, data and settings) to the checkpoint's state."""
    path = Path(path)
    meta: dict[str, Any] = json.loads((path / CHECKPOINT_META).read_text())
    saved = FinetuneHyperparameters.from_dict(meta["hyperparameters"])
    if saved != trainer.hparams:
        raise CheckpointError(f"{path}: hyperparameters {saved} differ from {trainer.hparams}")
    if meta["data_fingerprint"] != data_fingerprint(trainer.stream.examples):
        raise CheckpointError(f"{path}: was written for different training data")
    load_adapter_weights(trainer.model, path)
    state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.rng.load_state_dict(state["rng"])
    trainer.stream.restore(DataPosition.from_dict(state["position"]))
    if trainer.has_pending_gradients:
        raise RuntimeError("cannot restore progress while a batch is half accumulated")
    trainer.optimizer_tail.restore(int(state["step"]), state["history"])
    restore_preference = getattr(trainer, "restore_preference_history", None)
    if restore_preference is not None:
        restore_preference(state.get("preference_history", []))
