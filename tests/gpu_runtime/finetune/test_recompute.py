"""Activation recomputation chosen per quantum: the same losses, gradients and dropout masks as
without it (the masks are drawn once, outside the checkpointed layers), far fewer saved
activations, and its own graph key and pool group (CPU; the graphed check is in
test_graphs_gpu.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.batching import collate
from gpu_runtime.finetune.fused_forward import FusedTrainingForward
from gpu_runtime.finetune.graph_policy import CapturePolicy, GraphKey
from gpu_runtime.finetune.graph_pools import SHARED, PoolGroups, separate_except
from gpu_runtime.finetune.graphs import graph_key
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM


def _hparams(n: int, dropout: float, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "n_train_examples": n,
        "n_epochs": 2,
        "batch_size": 4,
        "lora": LoraSpec(rank=8, alpha=16, dropout=dropout, target_modules=("all-linear",)),
        "seed": 0,
        "warmup_ratio": 0.0,
        "learning_rate_multiplier": 20.0,
    }
    settings.update(overrides)
    return resolve_hyperparameters(**settings)


def _grads(trainer: LoraTrainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.params if p.grad is not None]


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recomputed_micro_batch_has_the_same_loss_and_gradients(
    serving_model: CausalLM, train_examples: Any, dropout: float
) -> None:
    """Two trainers from the same seed: one quantum without, one with recomputation, then the
    same pair again; losses, accumulated gradients and the trainers' RNG states agree."""
    hparams = _hparams(len(train_examples), dropout)
    plain = LoraTrainer(serving_model, train_examples, hparams)
    recomputing = LoraTrainer(serving_model, train_examples, hparams)
    with torch.no_grad():  # B = 0 at start: make the LoRA path (and its dropout) matter
        for a, b in zip(plain.params, recomputing.params, strict=True):
            a.normal_(0, 0.05, generator=torch.Generator().manual_seed(a.numel()))
            b.copy_(a)
    for _ in range(2):  # batch of 4, micro-batches of 2 examples: no optimizer step yet...
        first = plain.step_quantum(max_examples=1, recompute=False)
        second = recomputing.step_quantum(max_examples=1, recompute=True)
        assert not first.recompute and second.recompute
        assert first.loss == pytest.approx(second.loss, rel=1e-6)
        _assert_close(_grads(plain), _grads(recomputing))
        assert torch.equal(plain.rng.cpu_state, recomputing.rng.cpu_state)
    assert (plain.recompute_micro_batches, recomputing.recompute_micro_batches) == (0, 2)
    while not plain.finished:  # ...then whole batches, steps and all: same adapters
        without = plain.step_quantum(max_examples=2)
        recomputed = recomputing.step_quantum(max_examples=2)
        assert without.loss == pytest.approx(recomputed.loss, rel=1e-5)
    assert recomputing.finished and plain.step == recomputing.step > 0
    _assert_close([p.detach() for p in plain.params], [p.detach() for p in recomputing.params])


def test_dropout_masks_matter_and_the_recomputed_ones_are_the_forwards(
    serving_model: CausalLM, train_examples: Any
) -> None:
    """With dropout the loss depends on the masks drawn (another seed gives another loss), and
    a recomputed backward that drew fresh masks would give other gradients: this is what the
    equality above rules out."""
    hparams = _hparams(len(train_examples), 0.3)
    trainers = [LoraTrainer(serving_model, train_examples, hparams) for _ in range(2)]
    trainers[1].rng.cpu_state = torch.Generator().manual_seed(99).get_state()
    for t in trainers:
        with torch.no_grad():
            for p in t.params:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    losses = [t.step_quantum(max_examples=2, recompute=True).loss for t in trainers]
    assert losses[0] != pytest.approx(losses[1], rel=1e-6)


def test_the_trainers_default_mode_and_layer_sliced_quanta(
    serving_model: CausalLM, train_examples: Any
) -> None:
    """``trainer.recompute`` is the mode of quanta whose call does not say; a layer-sliced
    micro-batch keeps the mode it started with and ends with the whole one's gradients."""
    hparams = _hparams(len(train_examples), 0.2)
    whole = LoraTrainer(serving_model, train_examples, hparams)
    sliced = LoraTrainer(serving_model, train_examples, hparams)
    assert not whole.recompute
    whole.recompute = True
    assert whole.step_quantum(max_examples=2).recompute
    first = sliced.step_quantum(max_examples=2, max_layers=1, recompute=True)
    assert not first.micro_batch_done
    result = first
    while not result.micro_batch_done:
        result = sliced.step_quantum(max_layers=1, recompute=False)  # ignored mid-batch
    assert result.recompute and sliced.recompute_micro_batches == 1
    _assert_close(_grads(whole), _grads(sliced))


def test_recomputation_saves_only_the_layers_inputs(serving_model: CausalLM) -> None:
    """What autograd keeps for the backward outside the checkpointed layers: with
    recomputation, far less than every layer's activations."""
    tree = build_training_model(serving_model, LoraSpec(rank=8, dropout=0.1), 0)
    fast = FusedTrainingForward(tree, serving_model)
    ids = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).expand(2, 32)
    saved: dict[bool, int] = {}
    for recompute in (False, True):
        nbytes = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            nbytes += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = fast(ids, positions, activation_checkpointing=recompute)
        saved[recompute] = nbytes
        hidden.sum().backward()
        assert all(p.grad is not None for p in adapter_parameters(tree))
        tree.zero_grad(set_to_none=True)
    assert saved[True] < saved[False] / 5, saved


def test_a_recomputing_micro_batch_is_its_own_graph_and_pool_group(
    serving_model: CausalLM, train_examples: Any
) -> None:
    batch = collate(list(train_examples[:2]), seq_len=64)
    plain, recompute = graph_key(batch, 7), graph_key(batch, 7, recompute=True)
    assert plain != recompute and recompute == GraphKey(2, 64, plain.loss_slots, 7, True)
    policy = CapturePolicy()
    assert policy.decide(plain, stream_warm=True).action == "capture"
    policy.added(plain)
    assert policy.decide(plain, stream_warm=True).action == "replay"
    assert policy.decide(recompute, stream_warm=True).action == "capture"
    # every recomputing shape shared (beside decode's peak), the plain one pooled on its own
    groups = PoolGroups(separate_except({(1, True), (2, True), (4, True)}))
    for key in (recompute, GraphKey(4, 64, 64, 7, True), plain):
        groups.add(key)
    assert groups.keys_of(SHARED) == {recompute, GraphKey(4, 64, 64, 7, True)}
    assert groups.largest_separate() == ("shape", 2, False)
    # on the CPU a graphed trainer runs eagerly, passing the mode through to the same result
    hparams = _hparams(len(train_examples), 0.2)
    graphed = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=True)
    eager = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=False)
    assert graphed.graphs is not None
    for mode in (False, True, True):
        a = graphed.step_quantum(max_examples=2, recompute=mode)
        b = eager.step_quantum(max_examples=2, recompute=mode)
        assert a.graph == "eager" and a.recompute == b.recompute == mode
    assert graphed.graphs.disabled is not None  # the capture itself needs CUDA
