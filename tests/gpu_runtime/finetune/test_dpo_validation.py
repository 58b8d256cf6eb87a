"""A DPO job's validation pairs on the CPU with the tiny model (fp32): the validation loss and
preference accuracy against a direct computation, the seeded bounded sample at each checkpoint
and every pair at the last, in quanta that leave training untouched, and exact resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.checkpoint import load_checkpoint
from gpu_runtime.finetune.dpo_trainer import DpoTrainer
from gpu_runtime.finetune.preference_data import PreferencePair, tokenize_preference_lines
from gpu_runtime.finetune.validation import CHECKPOINT_METRIC_KEYS, validation_sample
from tests.gpu_runtime.finetune.test_dpo import TOY, direct_logps, hparams, preference_line

VALID = [
    ("colour of grass?", "green", "purple"),
    ("2 + 2", "4", "five"),
    ("greet me", "hello there", "go away"),
    ("opposite of up", "down", "sideways"),
    ("a fruit", "an apple", "a stone"),
    ("the sun is", "a star", "a planet"),
]


def _pairs(tokenizer: Any, rows: list[tuple[str, str, str]]) -> tuple[PreferencePair, ...]:
    lines = [preference_line(*row) for row in rows]
    return tokenize_preference_lines(lines, tokenizer, max_seq_len=64).pairs


@pytest.fixture()
def train(tokenizer: Any) -> tuple[PreferencePair, ...]:
    return _pairs(tokenizer, TOY[:4])


@pytest.fixture()
def valid(tokenizer: Any) -> tuple[PreferencePair, ...]:
    return _pairs(tokenizer, VALID)


def _perturb(trainer: DpoTrainer) -> None:
    with torch.no_grad():  # lora_B != 0: the policy differs from the reference
        for p in trainer.params:
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))


def _direct(trainer: DpoTrainer, serving_model: Any, pairs: Any) -> tuple[float, float]:
    """(mean DPO loss, fraction ranked right) of ``pairs``: the serving model's own forward as
    the reference, the peft tree in eval mode as the policy, full-vocabulary log-softmax."""
    rows = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    n = len(pairs)
    trainer.model.eval()
    try:
        with torch.no_grad():
            ref = direct_logps(serving_model, rows, peft_tree=False)
            policy = direct_logps(trainer.model, rows)
    finally:
        trainer.model.train()
    chosen = trainer.beta * (policy[:n] - ref[:n])
    rejected = trainer.beta * (policy[n:] - ref[n:])
    loss = -F.logsigmoid(chosen - rejected).mean()
    return float(loss), float((chosen > rejected).float().mean())


def test_dpo_validation_loss_and_accuracy_equal_a_direct_computation(
    serving_model: Any, train: Any, valid: Any
) -> None:
    budget = sum(p.num_tokens for p in valid) // 2  # the sample leaves pairs out
    trainer = DpoTrainer(
        serving_model,
        train,
        hparams(len(train), dpo_beta=0.5, lora=LoraSpec(rank=4, dropout=0.3)),
        validation_pairs=valid,
        valid_sample_tokens=budget,
        loss_chunk_tokens=3,
    )
    sample = trainer.checkpoints.valid_sample
    assert sample == validation_sample(valid, budget, 3) and 0 < len(sample) < len(valid)
    assert sum(p.num_tokens for p in sample) <= budget
    _perturb(trainer)
    trainer.step_quantum()  # a step, so train_loss is there; dropout 0.3 must be off in eval
    assert trainer.step == 1
    metrics = trainer.checkpoints.metrics(final=True)
    sample_loss, sample_accuracy = _direct(trainer, serving_model, sample)
    full_loss, full_accuracy = _direct(trainer, serving_model, valid)
    assert abs(full_loss - math.log(2)) > 1e-3  # the adapter moved the policy
    assert set(CHECKPOINT_METRIC_KEYS) <= set(metrics)
    assert metrics["valid_loss"] == pytest.approx(sample_loss, abs=1e-5)
    assert metrics["full_valid_loss"] == pytest.approx(full_loss, abs=1e-5)
    assert metrics["valid_preference_accuracy"] == pytest.approx(sample_accuracy, abs=1e-7)
    assert metrics["full_valid_preference_accuracy"] == pytest.approx(full_accuracy, abs=1e-7)
    assert metrics["train_loss"] == trainer.history[-1].loss
    for key in ("train", "valid", "full_valid"):
        assert metrics[f"{key}_mean_token_accuracy"] is None  # pairs have no token targets
    assert trainer.checkpoints.evaluate(valid, max_tokens=1) == pytest.approx(full_loss, abs=1e-5)
    early = trainer.checkpoints.metrics(final=False)
    assert early["full_valid_loss"] is None and early["full_valid_preference_accuracy"] is None
    assert early["valid_loss"] == metrics["valid_loss"]


def test_without_a_validation_file_the_valid_metrics_are_null(
    serving_model: Any, train: Any
) -> None:
    trainer = DpoTrainer(serving_model, train, hparams(len(train)))
    trainer.step_quantum()
    metrics = trainer.checkpoints.metrics(final=True)
    assert metrics["train_loss"] == trainer.history[-1].loss
    assert all(
        metrics[k] is None for k in ("valid_loss", "full_valid_loss", "valid_preference_accuracy")
    )


def _state(trainer: DpoTrainer) -> tuple[Any, ...]:
    optimizer = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for s in trainer.optimizer.state.values()
    ]
    return (
        [p.detach().clone() for p in trainer.params],
        [None if p.grad is None else p.grad.clone() for p in trainer.params],
        trainer.rng.cpu_state.clone(),
        optimizer,
        trainer.stream.position,
        trainer.step,
        len(trainer.preference_history),
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    params_a, grads_a, rng_a, opt_a, *rest_a = a
    params_b, grads_b, rng_b, opt_b, *rest_b = b
    return (
        all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
        and all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
            for x, y in zip(grads_a, grads_b, strict=True)
        )
        and torch.equal(rng_a, rng_b)
        and len(opt_a) == len(opt_b)
        and all(
            all(
                torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
                for k in x
            )
            for x, y in zip(opt_a, opt_b, strict=True)
        )
        and rest_a == rest_b
    )


def _run(trainer: DpoTrainer, max_tokens: int) -> tuple[list[dict[str, Any]], list[int]]:
    """Train to the end, one pair per quantum; (metrics of each checkpoint written, the number
    of validation quanta before each), checking that no validation quantum changes training."""
    written: list[dict[str, Any]] = []
    counts: list[int] = []
    while not trainer.finished:
        result = trainer.step_quantum(max_tokens=max_tokens)
        if not trainer.evaluating:
            assert result.checkpoint is None
            continue
        assert result.optimizer_step and result.checkpoint is None
        before = _state(trainer)
        quanta = []
        while trainer.evaluating:
            quanta.append(trainer.step_quantum(max_tokens=max_tokens))
            assert _same(before, _state(trainer))
        assert all(q.tokens == 0 and not q.optimizer_step for q in quanta)
        assert quanta[-1].checkpoint is not None and not any(q.checkpoint for q in quanta[:-1])
        assert (
            trainer.checkpoints.last_metrics is not None
            and trainer.checkpoints.last_metrics["step"] == trainer.step
        )
        written.append(trainer.checkpoints.last_metrics)
        counts.append(len(quanta))
    return written, counts


def test_validation_quanta_are_bounded_leave_training_untouched_and_resume_exactly(
    serving_model: Any, train: Any, valid: Any, tmp_path: Path
) -> None:
    settings = hparams(
        len(train),
        n_epochs=2,
        batch_size=2,
        lora=LoraSpec(rank=4, dropout=0.2),
        checkpoint_every_steps=2,
    )
    budget = sum(p.num_tokens for p in valid) // 2
    longest = max(p.num_tokens for p in (*train, *valid))  # one pair per micro-batch

    def trainer(root: Path | None, with_valid: bool = True) -> DpoTrainer:
        return DpoTrainer(
            serving_model,
            train,
            settings,
            checkpoint_root=root,
            validation_pairs=valid if with_valid else (),
            valid_sample_tokens=budget,
        )

    full = trainer(tmp_path / "a")
    written, counts = _run(full, longest)
    sample = len(full.checkpoints.valid_sample)
    assert [m["step"] for m in written] == [2, 4]
    assert counts == [sample, sample + len(valid)]  # one pair per quantum; every pair at the end
    assert written[0]["full_valid_loss"] is None and written[1]["full_valid_loss"] is not None
    assert written[1]["valid_loss"] != written[0]["valid_loss"]  # the adapter moved between

    plain = trainer(None, with_valid=False)  # no validation: the same training, to the bit
    while not plain.finished:
        plain.step_quantum(max_tokens=longest)
    assert [r.loss for r in plain.history] == [r.loss for r in full.history]
    for p, q in zip(full.params, plain.params, strict=True):
        assert torch.equal(p, q)

    resumed = trainer(tmp_path / "b")
    load_checkpoint(resumed, tmp_path / "a" / "step-000002")
    again, _ = _run(resumed, longest)
    assert [m["step"] for m in again] == [4]
    assert set(again[0]) == set(written[1])
    for key, value in written[1].items():
        if value is None:
            assert again[0][key] is None, key
        else:
            assert again[0][key] == pytest.approx(value, abs=1e-6), key
    for a, b in zip(full.history, resumed.history, strict=True):
        assert (a.step, a.learning_rate) == (b.step, b.learning_rate)
        assert abs(a.loss - b.loss) < 1e-6, (a, b)
    for p, q in zip(full.params, resumed.params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
