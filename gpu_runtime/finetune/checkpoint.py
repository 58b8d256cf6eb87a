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

A tensor-parallel tree (every rank calls these functions: they gather) writes exactly what one
GPU writes: the whole adapter and the whole optimizer moments
(:mod:`gpu_runtime.finetune.sharded_state`), rank 0 alone writing the files, and each rank's
trainer RNG beside rank 0's. Loading cuts each rank's slice, so a checkpoint resumes at any
degree, exactly (bit for bit) at the degree that wrote it.
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
from gpu_runtime.distributed.shard import ShardShape
from gpu_runtime.finetune.batching import DataPosition, DataStream
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.lora import (
    ADAPTER_NAME,
    PEFT_KEY_PREFIX,
    adapter_parameter_names,
    adapter_state_dict,
    lora_config,
)
from gpu_runtime.finetune.preference_data import PreferencePair
from gpu_runtime.finetune.quantum import StepRecord, TrainerRng
from gpu_runtime.finetune.sharded_state import (
    every_rank,
    local_optimizer_state,
    tree_parallel,
    whole_adapter_state,
    whole_extent,
    whole_optimizer_state,
)

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
    """Write the tree's adapter in PEFT format into ``directory`` (created if missing).

    A tensor-parallel tree's adapter is gathered whole on every rank (each calls this) and
    written by rank 0 only."""
    tensors = whole_adapter_state(tree, adapter_state_dict(tree))
    if not tree_parallel(tree)[0].is_driver:
        return
    _write_adapter(tensors, spec, Path(directory), base_model_name_or_path)


def _write_adapter(
    tensors: dict[str, torch.Tensor],
    spec: LoraSpec,
    directory: Path,
    base_model_name_or_path: str | None,
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lora_config(spec, base_model_name_or_path).save_pretrained(str(directory))
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
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
    """Copy an adapter's tensors into the tree's LoRA parameters; every key must match. The
    file holds whole tensors; a tensor-parallel tree keeps its rank's slice of each."""
    _, tensors = read_adapter(directory)
    parallel, shard = tree_parallel(tree)
    if parallel.size > 1 and shard is not None:
        tensors = {key: _slice_of_whole(shard, key, tensor) for key, tensor in tensors.items()}
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


def _slice_of_whole(shard: ShardShape, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the whole tensor ``key``; CheckpointError when it is not whole."""
    split = shard.split_of(key)
    if split is not None:
        dim, extent = split[0], whole_extent(shard, key)
        if tensor.dim() != 2 or tensor.shape[dim] != extent:
            raise CheckpointError(
                f"{key}: shape {tuple(tensor.shape)} is not a whole tensor ({extent} along "
                f"dimension {dim})"
            )
    return shard.take(key, tensor)


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
    """Write ``<root>/step-<trainer.step>`` atomically and return its path (on a
    tensor-parallel tree every rank calls it: the state is gathered, rank 0 writes, and every
    rank returns once it is written or raises if rank 0 could not write it)."""
    if trainer.has_pending_gradients:
        raise CheckpointError("checkpoints are taken between optimizer steps, not mid-batch")
    tree = trainer.model
    parallel, _ = tree_parallel(tree)
    names = adapter_parameter_names(tree)
    adapter = whole_adapter_state(tree, adapter_state_dict(tree))
    state: dict[str, Any] = {
        "step": trainer.step,
        "optimizer": whole_optimizer_state(tree, names, trainer.optimizer.state_dict()),
        "rng": trainer.rng.state_dict(),
        "position": trainer.stream.position.to_dict(),
        "history": [vars(record) for record in trainer.history],
    }
    if parallel.size > 1:
        state["rank_rngs"] = every_rank(parallel, state["rng"])
    preference = getattr(trainer, "preference_history", None)
    if preference is not None:
        state["preference_history"] = [vars(record) for record in preference]
    final = checkpoint_dir(root, trainer.step)
    if parallel.size == 1:
        _write_checkpoint(trainer, final, adapter, state, base_model_name_or_path)
        return final
    failure: str | None = None
    if parallel.is_driver:
        try:
            _write_checkpoint(trainer, final, adapter, state, base_model_name_or_path)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
            parallel.broadcast_object(failure)
            raise
    failure = parallel.broadcast_object(failure)
    if failure is not None:
        raise CheckpointError(f"rank 0 could not write {final}: {failure}")
    return final


def _write_checkpoint(
    trainer: CheckpointedTrainer,
    final: Path,
    adapter: dict[str, torch.Tensor],
    state: dict[str, Any],
    base_model_name_or_path: str | None,
) -> None:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _write_adapter(adapter, trainer.hparams.lora, tmp, base_model_name_or_path)
    torch.save(state, tmp / TRAINER_STATE)
    meta = {
        "step": trainer.step,
        "total_steps": trainer.total_steps,
        "hyperparameters": trainer.hparams.to_dict(),
        "data_fingerprint": data_fingerprint(trainer.stream.examples),
        "tensor_parallel_size": tree_parallel(trainer.model)[0].size,
    }
    (tmp / CHECKPOINT_META).write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def load_checkpoint(trainer: CheckpointedTrainer, path: str | Path) -> None:
    """Restore a fresh trainer (same model, data and settings) to the checkpoint's state, at
    any tensor-parallel degree: each rank takes its slice of the adapter and optimizer moments
    and, at the degree that wrote it, its own trainer RNG (rank 0's at another degree: dropout
    masks then differ from an uninterrupted run's, as they differ between degrees)."""
    path = Path(path)
    meta: dict[str, Any] = json.loads((path / CHECKPOINT_META).read_text())
    saved = FinetuneHyperparameters.from_dict(meta["hyperparameters"])
    if saved != trainer.hparams:
        raise CheckpointError(f"{path}: hyperparameters {saved} differ from {trainer.hparams}")
    if meta["data_fingerprint"] != data_fingerprint(trainer.stream.examples):
        raise CheckpointError(f"{path}: was written for different training data")
    load_adapter_weights(trainer.model, path)
    state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    names = adapter_parameter_names(trainer.model)
    parallel, _ = tree_parallel(trainer.model)
    trainer.optimizer.load_state_dict(
        local_optimizer_state(trainer.model, names, state["optimizer"])
    )
    rank_rngs = state.get("rank_rngs")
    same_degree = rank_rngs is not None and len(rank_rngs) == parallel.size
    trainer.rng.load_state_dict(rank_rngs[parallel.rank] if same_degree else state["rng"])
    trainer.stream.restore(DataPosition.from_dict(state["position"]))
    if trainer.has_pending_gradients:
        raise RuntimeError("cannot restore progress while a batch is half accumulated")
    trainer.optimizer_tail.restore(int(state["step"]), state["history"])
    restore_preference = getattr(trainer, "restore_preference_history", None)
    if restore_preference is not None:
        restore_preference(state.get("preference_history", []))
