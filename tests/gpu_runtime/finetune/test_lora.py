"""LoRA attaches to the serving model's own tensors and never changes its outputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.lora import (
    SharedWeightsError,
    adapter_parameters,
    build_training_model,
    check_shared_weights,
)
from gpu_runtime.finetune.loss import training_hidden_states
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config


def _tokens(vocab: int, batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("fused", [False, True])
def test_training_tree_shares_every_base_tensor(architecture: str, fused: bool) -> None:
    serving = build_random_model(tiny_config(architecture), seed=1, dtype="float32")
    if fused:
        serving.fuse_projections()
    tree = build_training_model(serving, LoraSpec(target_modules=("all-linear",)), seed=0)
    serving_ptrs = {n: p.data_ptr() for n, p in serving.named_parameters(remove_duplicate=False)}
    base = {
        n.replace(".base_layer.", "."): p
        for n, p in tree.named_parameters(remove_duplicate=False)
        if ".lora_" not in n
    }
    assert set(base) == set(serving_ptrs)
    for name, param in base.items():
        assert param.data_ptr() == serving_ptrs[name], name
        assert not param.requires_grad
    if architecture == "qwen2":  # tied embeddings stay tied in the tree
        assert tree.lm_head.weight is tree.model.embed_tokens.weight
    trainable = [n for n, p in tree.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * serving.config.num_hidden_layers
    assert all(p.dtype == torch.float32 for p in adapter_parameters(tree))


def test_step_zero_equals_base_model(serving_model: CausalLM) -> None:
    tree = build_training_model(serving_model, LoraSpec(dropout=0.3), seed=0)
    ids = _tokens(serving_model.config.vocab_size)
    with torch.no_grad():
        expected = serving_model(ids, _positions(ids))
        got = training_hidden_states(tree, ids, _positions(ids))
    assert torch.equal(got, expected)
    assert all(
        float(p.detach().abs().sum()) == 0.0 for n, p in tree.named_parameters() if ".lora_B." in n
    )


def test_training_forward_mirrors_model_forward_and_checkpointing(
    serving_model: CausalLM,
) -> None:
    tree = build_training_model(serving_model, LoraSpec(dropout=0.0), seed=0)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.normal_(0, 0.05)
    ids = _tokens(serving_model.config.vocab_size, seed=3)
    pos = _positions(ids)
    reference = tree(ids, pos)
    plain = training_hidden_states(tree, ids, pos)
    assert torch.equal(plain, reference)
    plain.square().sum().backward()
    grads = [p.grad.clone() for p in adapter_parameters(tree) if p.grad is not None]
    tree.zero_grad(set_to_none=True)
    recomputed = training_hidden_states(tree, ids, pos, activation_checkpointing=True)
    assert torch.equal(recomputed, reference)
    recomputed.square().sum().backward()
    again = [p.grad for p in adapter_parameters(tree) if p.grad is not None]
    assert len(again) == len(grads) > 0
    for a, b in zip(grads, again, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_serving_outputs_bit_identical_while_lora_trains(
    serving_model: CausalLM, train_examples: Any
) -> None:
    ids = _tokens(serving_model.config.vocab_size, seed=5)
    before_state = {k: v.clone() for k, v in serving_model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in serving_model.named_parameters()}
    with torch.no_grad():
        before = serving_model.compute_logits(serving_model(ids, _positions(ids)))
    hparams = resolve_hyperparameters(
        n_train_examples=len(train_examples), n_epochs=1, batch_size=2, seed=0
    )
    trainer = LoraTrainer(serving_model, train_examples, hparams, pad_to_multiple=1)
    adapter_before = [p.clone() for p in trainer.params]
    for _ in range(4):
        trainer.step_quantum(max_examples=1)
    assert trainer.step == 2
    assert any(not torch.equal(a, p) for a, p in zip(adapter_before, trainer.params, strict=True))
    with torch.no_grad():
        after = serving_model.compute_logits(serving_model(ids, _positions(ids)))
    assert torch.equal(before, after)
    for key, value in serving_model.state_dict().items():
        assert torch.equal(value, before_state[key]), key
    assert {n: p.requires_grad for n, p in serving_model.named_parameters()} == flags


def test_check_shared_weights_detects_a_copy(serving_model: CausalLM) -> None:
    tree = build_training_model(serving_model, LoraSpec(), seed=0)
    mlp: Any = tree.get_submodule("model.layers.0.mlp")
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.clone(), requires_grad=False)
    with pytest.raises(SharedWeightsError, match="up_proj.weight does not share storage"):
        check_shared_weights(serving_model, tree)
