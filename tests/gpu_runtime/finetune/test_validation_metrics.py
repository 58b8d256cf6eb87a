"""Token accuracy and validation loss, checked against a direct full-logits computation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.batching import collate
from gpu_runtime.finetune.checkpoint import load_checkpoint
from gpu_runtime.finetune.data import IGNORE_INDEX
from gpu_runtime.finetune.loss import training_hidden_states
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.finetune.validation import CHECKPOINT_METRIC_KEYS, validation_sample
from gpu_runtime.model import CausalLM


def _hparams(n: int, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "n_train_examples": n,
        "n_epochs": 1,
        "batch_size": 4,
        "lora": LoraSpec(rank=8, alpha=16, dropout=0.0),
        "seed": 0,
        "warmup_ratio": 0.0,
    }
    settings.update(overrides)
    return resolve_hyperparameters(**settings)


@torch.no_grad()
def _direct(tree: torch.nn.Module, examples: Any) -> tuple[float, float]:
    """(mean token loss, token accuracy) of ``examples`` from the full logits."""
    batch = collate(examples, pad_to_multiple=1)
    hidden = training_hidden_states(tree, batch.input_ids, batch.positions)  # type: ignore[arg-type]
    logits = tree.compute_logits(hidden)[:, :-1].float()  # type: ignore[operator]
    labels = batch.labels[:, 1:]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )
    mask = labels != IGNORE_INDEX
    hits = ((logits.argmax(-1) == labels) & mask).sum()
    count = int(mask.sum())
    return float(loss) / count, float(hits) / count


def _widen(model: CausalLM) -> None:
    with torch.no_grad():  # a random head this small predicts near uniform; make argmax matter
        model.lm_head.weight.mul_(25)


@pytest.mark.parametrize("quanta", ["whole", "micro", "sliced"])
def test_train_accuracy_is_the_batch_accuracy_before_its_step(
    serving_model: CausalLM, train_examples: Any, quanta: str
) -> None:
    _widen(serving_model)
    examples = train_examples[:4]
    hparams = _hparams(4, n_epochs=12, learning_rate_multiplier=50.0)
    trainer = LoraTrainer(serving_model, examples, hparams, fused_forward=False)
    for _ in range(10):  # a trained adapter, so some targets are predicted
        trainer.step_quantum()
    order = trainer.stream.plan(None, None, 1)  # the next batch is all 4 examples
    batch_examples = [trainer.stream.examples[i] for i in order.example_indices]
    trainer.model.train()
    loss, accuracy = _direct(trainer.model, batch_examples)
    if quanta == "whole":
        trainer.step_quantum()
    elif quanta == "micro":
        while trainer.step == 10:
            trainer.step_quantum(max_examples=1)
    else:
        while trainer.step == 10:
            trainer.step_quantum(max_layers=1)
    record = trainer.history[-1]
    assert record.step == 11
    assert record.loss == pytest.approx(loss, rel=1e-5)
    assert record.accuracy == pytest.approx(accuracy, abs=1e-6)
    assert 0.0 < accuracy < 1.0, accuracy


def test_checkpoints_carry_validation_metrics_measured_in_eval_mode(
    serving_model: CausalLM, train_examples: Any, tmp_path: Path
) -> None:
    _widen(serving_model)
    train, valid = train_examples[:6], train_examples[6:]
    hparams = _hparams(
        6, n_epochs=2, batch_size=3, checkpoint_every_steps=2, lora=LoraSpec(rank=8, dropout=0.3)
    )
    budget = sum(e.num_tokens for e in valid) - 1  # the sample must leave one example out
    trainer = LoraTrainer(
        serving_model,
        train,
        hparams,
        checkpoint_root=tmp_path,
        validation_examples=valid,
        valid_sample_tokens=budget,
    )
    sample = validation_sample(valid, budget, hparams.seed)
    assert 0 < len(sample) < len(valid) and sample == trainer.checkpoints.valid_sample
    seen: list[dict[str, Any]] = []
    while not trainer.finished:
        result = trainer.step_quantum()
        if result.checkpoint is None:
            continue
        metrics = trainer.checkpoints.last_metrics
        assert metrics is not None and metrics["step"] == trainer.step
        assert set(CHECKPOINT_METRIC_KEYS) <= set(metrics)
        trainer.model.eval()  # dropout off, as the validation pass runs
        sample_loss, sample_accuracy = _direct(trainer.model, sample)
        full_loss, full_accuracy = _direct(trainer.model, valid)
        trainer.model.train()
        assert metrics["valid_loss"] == pytest.approx(sample_loss, rel=1e-5)
        assert metrics["valid_mean_token_accuracy"] == pytest.approx(sample_accuracy, abs=1e-6)
        assert metrics["train_loss"] == trainer.history[-1].loss
        assert metrics["train_mean_token_accuracy"] == trainer.history[-1].accuracy
        if trainer.finished:
            assert metrics["full_valid_loss"] == pytest.approx(full_loss, rel=1e-5)
            assert metrics["full_valid_mean_token_accuracy"] == pytest.approx(
                full_accuracy, abs=1e-6
            )
        else:
            assert metrics["full_valid_loss"] is None
        seen.append(metrics)
    assert [m["step"] for m in seen] == [2, 4]
    # the history (accuracy included) survives a checkpoint round trip
    resumed = LoraTrainer(serving_model, train, hparams, validation_examples=valid)
    assert result.checkpoint is not None
    load_checkpoint(resumed, result.checkpoint)
    assert [r.accuracy for r in resumed.history] == [r.accuracy for r in trainer.history]


def test_no_validation_file_leaves_valid_metrics_null(
    serving_model: CausalLM, train_examples: Any
) -> None:
    trainer = LoraTrainer(serving_model, train_examples[:4], _hparams(4))
    trainer.step_quantum()
    metrics = trainer.checkpoints.metrics(final=True)
    assert metrics["train_loss"] == trainer.history[-1].loss
    assert metrics["valid_loss"] is None and metrics["full_valid_loss"] is None


def test_validation_runs_as_bounded_quanta_before_the_checkpoint_is_written(
    serving_model: CausalLM, train_examples: Any, tmp_path: Path
) -> None:
    train, valid = train_examples[:4], train_examples[4:]
    hparams = _hparams(4, n_epochs=2, batch_size=4, checkpoint_every_steps=1)
    trainer = LoraTrainer(
        serving_model, train, hparams, checkpoint_root=tmp_path, validation_examples=valid
    )
    longest = max(e.num_tokens for e in valid)
    first = trainer.step_quantum()
    assert first.optimizer_step and first.checkpoint is None and trainer.evaluating
    position = trainer.stream.position
    evaluated = []
    while trainer.evaluating:  # one example per quantum at this budget
        evaluated.append(trainer.step_quantum(max_tokens=longest))
        assert trainer.stream.position == position and trainer.step == 1
    assert len(evaluated) == len(
        trainer.checkpoints.valid_sample
    )  # the sample only: not the last step
    assert all(r.tokens == 0 and not r.optimizer_step for r in evaluated)
    assert [r.checkpoint is not None for r in evaluated][-1] and not any(
        r.checkpoint for r in evaluated[:-1]
    )
    assert (
        trainer.checkpoints.last_metrics is not None
        and trainer.checkpoints.last_metrics["step"] == 1
    )
    last = trainer.step_quantum()
    assert last.optimizer_step and trainer.stream.finished and not trainer.finished
    final = []
    while not trainer.finished:
        final.append(trainer.step_quantum(max_tokens=longest))
    assert final[-1].finished and final[-1].checkpoint is not None
    assert len(final) == len(trainer.checkpoints.valid_sample) + (
        len(valid) if len(valid) != len(trainer.checkpoints.valid_sample) else 0
    )
    metrics = trainer.checkpoints.last_metrics
    assert metrics is not None and metrics["step"] == 2 and metrics["full_valid_loss"] is not None
    with pytest.raises(RuntimeError):
        trainer.step_quantum()
