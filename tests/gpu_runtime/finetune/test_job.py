"""A job from files and control-plane settings; a second host resumes it from its checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.job import open_job


def test_job_resumes_on_another_host(
    tmp_path: Path, tokenizer: Any, train_lines: list[str], serving_model: Any
) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(train_lines) + "\n")
    valid = tmp_path / "valid.jsonl"
    valid.write_text("\n".join(train_lines[:3]) + "\n")
    settings: dict[str, Any] = {
        "training_file": train,
        "validation_file": valid,
        "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": "auto"},
        "lora": LoraSpec(rank=4, dropout=0.1),
        "seed": 3,
        "checkpoint_every_steps": 2,
    }
    uninterrupted = open_job(serving_model, tokenizer, checkpoint_root=tmp_path / "a", **settings)
    assert uninterrupted.resumed_from is None
    assert uninterrupted.trainer.total_steps == 6  # 10 examples, batches of 4: 3 per epoch
    assert uninterrupted.trainer.hparams.learning_rate == 2e-4
    first_validation = uninterrupted.validation_loss()
    while not uninterrupted.trainer.finished:
        uninterrupted.trainer.step_quantum(max_tokens=48)
    assert uninterrupted.validation_loss() != first_validation

    host_one = open_job(serving_model, tokenizer, checkpoint_root=tmp_path / "b", **settings)
    while host_one.trainer.step < 3:  # checkpoint at step 2, lost at step 3
        host_one.trainer.step_quantum(max_tokens=48)
    host_two = open_job(serving_model, tokenizer, checkpoint_root=tmp_path / "b", **settings)
    assert host_two.resumed_from == tmp_path / "b" / "step-000002"
    while not host_two.trainer.finished:
        host_two.trainer.step_quantum(max_tokens=48)  # same quanta: same dropout masks
    losses = [h.loss for h in uninterrupted.trainer.history]
    assert [h.loss for h in host_two.trainer.history] == pytest.approx(losses, rel=1e-5)
    assert (tmp_path / "b" / "step-000006" / "adapter_model.safetensors").exists()
    assert host_two.trainer.graphs is None  # CPU default
    # CUDA graphs are an execution setting: a job resumes with them switched on
    host_three = open_job(
        serving_model, tokenizer, checkpoint_root=tmp_path / "b", cuda_graphs=True, **settings
    )
    assert host_three.resumed_from is not None and host_three.trainer.graphs is not None


def test_job_rejects_unknown_hyperparameters(
    tmp_path: Path, tokenizer: Any, train_lines: list[str], serving_model: Any
) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(train_lines))
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        open_job(
            serving_model,
            tokenizer,
            training_file=train,
            checkpoint_root=tmp_path,
            hyperparameters={"epochs": 3},
        )
