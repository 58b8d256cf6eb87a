"""The fused training forward equals the peft-wrapped tree (dropout 0), values and gradients."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.fused_forward import FusedTrainingForward
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.loss import training_hidden_states
from gpu_runtime.model import build_random_model
from gpu_runtime.model.tiny import tiny_config


@pytest.mark.parametrize(
    ("architecture", "targets", "fused"),
    [
        ("llama", ("all-linear",), True),
        ("llama", ("q_proj", "v_proj", "down_proj"), False),
        ("qwen2", ("q_proj", "k_proj", "v_proj", "o_proj"), True),
        ("qwen2", ("k_proj", "up_proj"), False),
    ],
)
def test_fused_forward_equals_peft_tree(
    architecture: str, targets: tuple[str, ...], fused: bool
) -> None:
    serving = build_random_model(tiny_config(architecture), seed=3, dtype="float32")
    if fused:
        serving.fuse_projections()
    tree = build_training_model(serving, LoraSpec(rank=4, dropout=0.0, target_modules=targets), 0)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.normal_(0, 0.1)
    fast = FusedTrainingForward(tree, serving)
    ids = torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11).expand(2, 11)
    weights = torch.randn(2, 11, serving.config.hidden_size)

    reference = training_hidden_states(tree, ids, positions)
    (reference * weights).sum().backward()
    expected = [p.grad.clone() for p in adapter_parameters(tree) if p.grad is not None]
    tree.zero_grad(set_to_none=True)
    for checkpointing in (False, True):
        got = fast(ids, positions, activation_checkpointing=checkpointing)
        # The fused GEMMs sum in another order than the peft tree (and that order depends on
        # the BLAS thread count): compare against the tensor's scale, as for the gradients. A
        # missing or wrong LoRA term moves outputs by ~1e-1 here.
        scale = float(reference.abs().max())
        assert float((got - reference).abs().max()) <= 1e-4 * scale + 1e-7
        (got * weights).sum().backward()
        grads = [p.grad for p in adapter_parameters(tree) if p.grad is not None]
        assert (
            len(grads)
            == len(expected)
            == 2 * len(tree.model.layers) * len(LoraSpec(target_modules=targets).target_modules)
        )
        for g, e in zip(grads, expected, strict=True):
            # fp32 rounding differs with summation order: compare against the tensor's scale
            assert float((g - e).abs().max()) <= 1e-4 * float(e.abs().max()) + 1e-7
        tree.zero_grad(set_to_none=True)


def test_fused_forward_dropout_trains_only_in_train_mode() -> None:
    serving = build_random_model(tiny_config("llama"), seed=3, dtype="float32")
    tree = build_training_model(serving, LoraSpec(rank=4, dropout=0.5), 0)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.normal_(0, 0.1)
    fast = FusedTrainingForward(tree, serving)
    ids = torch.randint(0, 400, (1, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8)[None]
    tree.eval()
    with torch.no_grad():
        assert torch.equal(fast(ids, positions), fast(ids, positions))
        tree.train()
        assert not torch.equal(fast(ids, positions), fast(ids, positions))
