"""Quanta, accumulation, schedule, chunked loss and validation loss on a tiny model."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.contract.hparams import (
    HyperparameterError,
    LoraSpec,
    resolve_hyperparameters,
)
from gpu_runtime.finetune.batching import collate
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.loss import chunked_lm_head_loss, training_hidden_states
from gpu_runtime.finetune.schedule import LrSchedule
from gpu_runtime.finetune.trainer import LoraTrainer
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


def test_loss_decreases_on_tiny_overfit_set(serving_model: CausalLM, train_examples: Any) -> None:
    examples = train_examples[:4]
    with torch.no_grad():  # a random head this small caps logits near uniform; widen it
        serving_model.lm_head.weight.mul_(25)
    hparams = _hparams(
        4, n_epochs=20, learning_rate_multiplier=50.0, lora=LoraSpec(rank=8, dropout=0.0)
    )
    trainer = LoraTrainer(serving_model, examples, hparams)
    first = trainer.checkpoints.evaluate(examples)
    while not trainer.finished:
        trainer.step_quantum()
    assert trainer.step == 20
    last = trainer.checkpoints.evaluate(examples)
    assert last < 0.2 * first, (first, last)
    assert trainer.history[-1].loss < trainer.history[0].loss


def test_quantum_results_and_bounds(serving_model: CausalLM, train_examples: Any) -> None:
    hparams = _hparams(len(train_examples), batch_size=4)  # 10 examples: batches 4, 4, 2
    trainer = LoraTrainer(serving_model, train_examples, hparams, pad_to_multiple=1)
    assert trainer.total_steps == 3
    results = []
    while not trainer.finished:
        results.append(trainer.step_quantum(max_examples=3))
    assert [r.examples for r in results] == [3, 1, 3, 1, 2]
    assert [r.optimizer_step for r in results] == [False, True, False, True, True]
    assert [r.step for r in results] == [0, 1, 1, 2, 3]
    assert sum(r.examples for r in results) == len(train_examples)
    assert sum(r.tokens for r in results) == sum(e.num_tokens for e in train_examples)
    assert sum(r.loss_tokens for r in results) == sum(e.num_loss_tokens for e in train_examples)
    for r in results:
        assert r.tokens <= r.padded_tokens
        assert r.wall_s > 0 and r.loss is not None and math.isfinite(r.loss)
        assert r.peak_memory_bytes is None  # CPU
        assert (r.grad_norm is not None) == r.optimizer_step == (r.learning_rate is not None)
    assert results[-1].finished and results[-1].position.epoch == 1
    assert [h.step for h in trainer.history] == [1, 2, 3]
    with pytest.raises(RuntimeError, match="finished"):
        trainer.step_quantum()
    # A token bound smaller than one example still runs exactly one example.
    small = LoraTrainer(serving_model, train_examples, hparams, pad_to_multiple=1)
    assert small.step_quantum(max_tokens=1).examples == 1


def test_accumulation_matches_one_big_batch(serving_model: CausalLM, train_examples: Any) -> None:
    hparams = _hparams(len(train_examples), n_epochs=2, batch_size=4)
    whole = LoraTrainer(serving_model, train_examples, hparams)
    split = LoraTrainer(serving_model, train_examples, hparams)
    while not whole.finished:
        whole.step_quantum(max_examples=4)
    sizes = [1, 2, 3]
    i = 0
    while not split.finished:
        split.step_quantum(max_examples=sizes[i % 3])
        i += 1
    assert split.step == whole.step == 6
    for a, b in zip(whole.history, split.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    for p, q in zip(whole.params, split.params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_chunked_loss_equals_full_logits_loss(serving_model: CausalLM, train_examples: Any) -> None:
    tree = build_training_model(serving_model, LoraSpec(dropout=0.0), seed=0)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.normal_(0, 0.05)
    batch = collate(train_examples[:3], pad_to_multiple=8)
    hidden = training_hidden_states(tree, batch.input_ids, batch.positions)
    chunked = chunked_lm_head_loss(tree, hidden, batch.loss_positions, batch.loss_targets, 5)
    chunked.backward()
    grads = [p.grad.clone() for p in adapter_parameters(tree) if p.grad is not None]
    tree.zero_grad(set_to_none=True)
    hidden = training_hidden_states(tree, batch.input_ids, batch.positions)
    logits = tree.compute_logits(hidden)[:, :-1]
    reference = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.labels[:, 1:].reshape(-1), reduction="sum"
    )
    reference.backward()
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=1e-5)
    assert batch.loss_targets.numel() == batch.num_loss_tokens
    for p, g in zip(
        [p for p in adapter_parameters(tree) if p.grad is not None], grads, strict=True
    ):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_evaluate_is_side_effect_free(serving_model: CausalLM, train_examples: Any) -> None:
    hparams = _hparams(len(train_examples), lora=LoraSpec(dropout=0.2))
    trainer = LoraTrainer(serving_model, train_examples, hparams)
    trainer.step_quantum(max_examples=2)
    position, rng = trainer.stream.position, trainer.rng.cpu_state.clone()
    grads = [None if p.grad is None else p.grad.clone() for p in trainer.params]
    a = trainer.checkpoints.evaluate(train_examples, max_tokens=64)
    b = trainer.checkpoints.evaluate(train_examples, max_tokens=10_000)
    assert a == pytest.approx(b, rel=1e-6)
    run = trainer.checkpoints.validation(
        train_examples, max_tokens=40
    )  # bounded steps for a scheduler
    steps = 1
    while not run.step():
        steps += 1
    assert steps >= 5 and run.loss == pytest.approx(a, rel=1e-6)
    assert trainer.stream.position == position
    assert torch.equal(trainer.rng.cpu_state, rng)
    for g, p in zip(grads, trainer.params, strict=True):
        if g is None or p.grad is None:
            assert g is None and p.grad is None
        else:
            assert torch.equal(g, p.grad)


def test_trainer_randomness_is_isolated_from_global_rng(
    serving_model: CausalLM, train_examples: Any
) -> None:
    hparams = _hparams(len(train_examples), lora=LoraSpec(dropout=0.5))
    first = LoraTrainer(serving_model, train_examples, hparams)
    second = LoraTrainer(serving_model, train_examples, hparams)
    losses: list[list[float | None]] = []
    for trainer in (first, second):
        torch.manual_seed(len(losses) * 1000 + 7)  # e.g. decode sampling between quanta
        losses.append([trainer.step_quantum(max_examples=2).loss for _ in range(4)])
        torch.rand(100)
    assert losses[0] == losses[1]


def test_lr_schedule_warmup_and_decay() -> None:
    cosine = LrSchedule(1.0, total_steps=10, warmup_steps=2, kind="cosine")
    assert [round(cosine.rate(s), 4) for s in range(3)] == [0.3333, 0.6667, 1.0]
    assert cosine.rate(6) == pytest.approx(0.5)
    assert 0 < cosine.rate(9) < cosine.rate(8)
    linear = LrSchedule(2.0, total_steps=4, warmup_steps=0, kind="linear")
    assert [linear.rate(s) for s in range(4)] == [2.0, 1.5, 1.0, 0.5]
    with pytest.raises(ValueError, match="warmup_steps"):
        LrSchedule(1.0, total_steps=4, warmup_steps=5)


def test_auto_hyperparameters_resolve_as_documented() -> None:
    small = resolve_hyperparameters(n_train_examples=10)
    assert (small.n_epochs, small.batch_size, small.learning_rate) == (10, 1, 2e-4)
    large = resolve_hyperparameters(n_train_examples=5000, learning_rate_multiplier=0.5)
    assert (large.n_epochs, large.batch_size, large.learning_rate) == (3, 32, 1e-4)
    assert LoraSpec(target_modules=("all-linear",)).target_modules[-1] == "down_proj"
    with pytest.raises(HyperparameterError, match="lm_head"):
        LoraSpec(target_modules=("q_proj", "lm_head"))
    with pytest.raises(HyperparameterError, match="batch_size"):
        resolve_hyperparameters(n_train_examples=5, batch_size=0)


@pytest.mark.parametrize("fused", [True, False])
def test_layer_sliced_quanta_equal_whole_micro_batches(
    serving_model: CausalLM, train_examples: Any, fused: bool
) -> None:
    hparams = _hparams(len(train_examples), batch_size=4, lora=LoraSpec(rank=4, dropout=0.3))
    whole = LoraTrainer(serving_model, train_examples, hparams, fused_forward=fused)
    sliced = LoraTrainer(serving_model, train_examples, hparams, fused_forward=fused)
    while not whole.finished:
        whole.step_quantum(max_examples=2)
    layers = serving_model.config.num_hidden_layers  # 2
    results = []
    while not sliced.finished:
        results.append(sliced.step_quantum(max_examples=2, max_layers=1))
    # per micro-batch: forward layer 0, forward layer 1 + loss, backward 1, backward 0
    assert len(results) == 2 * layers * 5  # 10 examples in micro-batches of 2
    done = [r for r in results if r.micro_batch_done]
    assert len(done) == 5 and all(r.examples == 2 and r.loss is not None for r in done)
    partial = [r for r in results if not r.micro_batch_done]
    assert all(r.tokens == 0 and r.loss is None and r.layer_passes == 1 for r in partial)
    for a, b in zip(whole.history, sliced.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
    for p, q in zip(whole.params, sliced.params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_no_checkpoint_mid_micro_batch(serving_model: CausalLM, train_examples: Any) -> None:
    from gpu_runtime.finetune.checkpoint import CheckpointError, save_checkpoint

    trainer = LoraTrainer(serving_model, train_examples, _hparams(len(train_examples)))
    result = trainer.step_quantum(max_examples=4, max_layers=3)  # forward 2 layers + loss
    assert not result.micro_batch_done and result.layer_passes == 2
    with pytest.raises(CheckpointError, match="mid-batch"):
        save_checkpoint(trainer, "/nonexistent")
    result = trainer.step_quantum(max_layers=8)
    assert result.micro_batch_done and result.optimizer_step and result.layer_passes == 2
