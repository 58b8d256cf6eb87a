"""Stage-2 quanta come from the finetune engine's LoraTrainer (CPU, tiny model: eager quanta)."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_runtime.model import ModelConfig, build_random_model
from predictor_models.profile import sample_finetune
from predictor_models.trainer_source import (
    OPTIMIZER_BATCH,
    TrainerQuanta,
    TrainerQuantumError,
    synthetic_examples,
)


def test_trainer_quanta_train_micro_batches_over_the_serving_weights() -> None:
    model = build_random_model(ModelConfig.preset("tiny"), seed=0)
    model.fuse_projections()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    quanta = TrainerQuanta(model, seed=0)
    quantum = quanta.quantum(rank=4, seq_len=32, micro_batch=2)
    trainer = quantum.trainer
    assert trainer.hparams.lora.rank == 4 and trainer.hparams.lora.dropout == 0.0
    assert quanta.quantum(4, 32, 4).trainer is trainer  # one trainer per (rank, seq_len)
    assert quanta.quantum(8, 32, 2).trainer is not trainer
    assert quantum.warm(None) > 0.0  # CPU: no graphs, the first quantum counts
    assert quantum.modes == ["off"]
    for _ in range(OPTIMIZER_BATCH // 2 - 1):
        quantum.run()
    assert trainer.step == 1  # four 2-example micro-batches made one optimizer batch
    assert trainer.history[0].tokens == OPTIMIZER_BATCH * 32
    quantum.check_replayed(0)  # "off" counts as the trainer's normal mode here
    quantum.modes.append("eager")
    with pytest.raises(TrainerQuantumError, match="eager"):
        quantum.check_replayed(0)
    for name, param in model.named_parameters():  # base weights shared, never written
        torch.testing.assert_close(param, before[name], rtol=0, atol=0)
    lora_b = [p for n, p in trainer.model.named_parameters() if ".lora_B" in n]
    assert lora_b and any(float(p.detach().abs().max()) > 0 for p in lora_b)  # the adapter trained
    single = quanta.quantum(4, 32, 1)
    single.run()  # position 9: one example into the second optimizer batch
    pair = quanta.quantum(4, 32, 2)
    pair.warm(None)  # runs the batch's other 7 examples first, then a whole pair
    assert trainer.step == 2 and trainer.stream.position.index == 18
    pair.run()
    quanta.release()
    info = quanta.describe()
    assert info["rank4-seq32"]["optimizer_steps"] == 2
    with pytest.raises(ValueError, match="divide"):
        quanta.quantum(4, 32, 3)


def test_synthetic_examples_and_quantum_sizes() -> None:
    examples = synthetic_examples(5, 16, vocab=100, seed=1)
    assert len(examples) == 5 and all(e.num_tokens == 16 for e in examples)
    assert all(e.input_ids == e.labels for e in examples)
    assert examples[0].input_ids != examples[1].input_ids
    assert synthetic_examples(5, 16, 100, 1) == examples  # seeded
    rng = random.Random(0)
    for _ in range(300):
        cap = rng.choice((100, 600, 1500, 4096))
        tokens, seq_len, rank = sample_finetune(rng, cap)
        micro_batch = tokens // seq_len
        assert tokens == micro_batch * seq_len and OPTIMIZER_BATCH % micro_batch == 0
        assert tokens <= max(cap, 256) and rank in (8, 16, 64)
