"""DPO on CUDA in bf16 (the path hosts train on): step 0 is log 2, preference accuracy rises on
the toy set, and a validation file's DPO loss is measured at the final checkpoint."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.dpo_trainer import DpoTrainer
from gpu_runtime.finetune.preference_data import PreferencePair, tokenize_preference_lines
from tests.gpu_runtime.finetune.conftest import cuda_serving_model
from tests.gpu_runtime.finetune.test_dpo import TOY, hparams, preference_line

pytestmark = pytest.mark.gpu


@pytest.fixture()
def pairs(tokenizer: Any) -> tuple[PreferencePair, ...]:
    lines = [preference_line(*row) for row in TOY]
    return tokenize_preference_lines(lines, tokenizer, max_seq_len=64).pairs


def test_dpo_on_cuda_starts_at_log_2_and_learns_the_toy_preferences(
    pairs: tuple[PreferencePair, ...],
) -> None:
    trainer = DpoTrainer(
        cuda_serving_model(),
        pairs,
        hparams(len(pairs), n_epochs=12, lora=LoraSpec(rank=8)),
        validation_pairs=pairs[:4],
    )
    first = trainer.step_quantum()
    assert first.optimizer_step
    # the policy (adapter B = 0) and the reference (adapter off) compute the same logits
    assert first.batch_loss == pytest.approx(math.log(2), abs=2e-3)
    while not trainer.finished:
        trainer.step_quantum(max_examples=3)
    late = trainer.preference_history[-6:]
    assert sum(r.accuracy for r in late) / len(late) >= 0.9, trainer.preference_history
    assert trainer.history[-1].loss < math.log(2) - 0.1
    assert trainer.history[-1].accuracy is None  # pairs have no token targets
    metrics = trainer.checkpoints.metrics(final=True)
    assert metrics["full_valid_loss"] is not None and metrics["valid_loss"] is not None
    assert metrics["full_valid_loss"] < math.log(2)
    assert metrics["full_valid_preference_accuracy"] >= 0.75
