"""PEFT-format adapters load into HF + peft with equal outputs; resume reproduces the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.checkpoint import (
    CheckpointError,
    load_adapter_weights,
    load_checkpoint,
    save_adapter,
    save_checkpoint,
)
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.loss import training_hidden_states
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import build_random_model, save_model
from gpu_runtime.model.tiny import tiny_config


@pytest.mark.parametrize(
    ("architecture", "targets"),
    [("llama", ("q_proj", "k_proj", "v_proj", "o_proj")), ("qwen2", ("all-linear",))],
)
def test_adapter_loads_in_peft_over_hf_model_with_equal_outputs(
    tmp_path: Path, architecture: str, targets: tuple[str, ...]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    serving = build_random_model(tiny_config(architecture), seed=2, dtype="float32")
    save_model(serving, tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8, dropout=0.1, target_modules=targets)
    tree = build_training_model(serving, spec, seed=0)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.normal_(0, 0.1)  # a trained-looking adapter: B non-zero
    save_adapter(tree, spec, tmp_path / "adapter", base_model_name_or_path="tiny")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    tree.eval()
    with torch.no_grad():
        ours = tree.compute_logits(
            training_hidden_states(tree, ids, torch.arange(16).expand(2, 16))
        )
        base = serving.compute_logits(serving(ids, torch.arange(16).expand(2, 16)))
        reference = peft_model(input_ids=ids).logits
    assert not torch.allclose(ours, base, atol=1e-3)  # the adapter changes the outputs
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_adapter_key_mismatch_is_an_error(tmp_path: Path, serving_model: Any) -> None:
    qv = build_training_model(serving_model, LoraSpec(target_modules=("q_proj", "v_proj")), 0)
    save_adapter(qv, LoraSpec(target_modules=("q_proj", "v_proj")), tmp_path / "qv")
    qkvo = build_training_model(serving_model, LoraSpec(), 0)
    with pytest.raises(CheckpointError, match=r"missing keys .*k_proj"):
        load_adapter_weights(qkvo, tmp_path / "qv")
    q = build_training_model(serving_model, LoraSpec(target_modules=("q_proj",)), 0)
    with pytest.raises(CheckpointError, match=r"unexpected keys .*v_proj"):
        load_adapter_weights(q, tmp_path / "qv")


def test_resume_reproduces_the_uninterrupted_loss_curve(
    tmp_path: Path, serving_model: Any, train_examples: Any
) -> None:
    hparams = resolve_hyperparameters(
        n_train_examples=len(train_examples),
        n_epochs=2,
        batch_size=3,
        learning_rate_multiplier=10.0,
        lora=LoraSpec(rank=4, dropout=0.2),  # dropout: resume must restore RNG too
        seed=5,
        checkpoint_every_steps=2,
        warmup_ratio=0.2,
    )
    full = LoraTrainer(serving_model, train_examples, hparams, checkpoint_root=tmp_path / "a")
    written = []
    while not full.finished:
        result = full.step_quantum(max_examples=2)
        if result.checkpoint is not None:
            written.append(result.checkpoint.name)
    assert full.step == 8
    assert written == ["step-000002", "step-000004", "step-000006", "step-000008"]
    assert not list((tmp_path / "a").glob(".*tmp*"))

    resumed = LoraTrainer(serving_model, train_examples, hparams)
    load_checkpoint(resumed, tmp_path / "a" / "step-000004")
    assert resumed.step == 4 and len(resumed.history) == 4
    while not resumed.finished:
        resumed.step_quantum(max_examples=2)
    for a, b in zip(full.history, resumed.history, strict=True):
        assert a.step == b.step
        assert abs(a.loss - b.loss) < 1e-5, (a, b)
        assert a.learning_rate == b.learning_rate
    for p, q in zip(full.params, resumed.params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_resume_refuses_other_settings_or_data(
    tmp_path: Path, serving_model: Any, train_examples: Any
) -> None:
    hparams = resolve_hyperparameters(
        n_train_examples=len(train_examples), n_epochs=1, batch_size=2, seed=0
    )
    trainer = LoraTrainer(serving_model, train_examples, hparams)
    trainer.step_quantum(max_examples=1)
    with pytest.raises(CheckpointError, match="mid-batch"):
        save_checkpoint(trainer, tmp_path)
    trainer.step_quantum(max_examples=1)
    path = save_checkpoint(trainer, tmp_path)
    other_seed = resolve_hyperparameters(
        n_train_examples=len(train_examples), n_epochs=1, batch_size=2, seed=1
    )
    with pytest.raises(CheckpointError, match="hyperparameters"):
        load_checkpoint(LoraTrainer(serving_model, train_examples, other_seed), path)
    with pytest.raises(CheckpointError, match="different training data"):
        load_checkpoint(LoraTrainer(serving_model, train_examples[1:], hparams), path)
