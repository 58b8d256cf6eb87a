"""LoRA under tensor parallelism on CPU (gloo, 2 and 4 ranks, fp32): serving and training equal
one GPU's, adapters round-trip between degrees.

One spawned run per degree does all of a rank's work (each spawn costs seconds): serve a
one-GPU-trained adapter (rslora and an alpha pattern on, all seven projections) beside a base
request through `MultiLoraRuntime`; train a LoRA job on the same model (clipping active,
dropout 0), once more with dropout, and a DPO job; resume the first from a mid-run
checkpoint; load the one-GPU job's final adapter into a training tree. At 4 ranks the tiny
model's 2 KV heads are replicated (k/v `lora_B` gradients summed over the ranks sharing a
head). The tests then compare each result with the one-GPU run's in this process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.training_examples import PreferencePair, TokenizedExample
from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.finetune.checkpoint import (
    ADAPTER_WEIGHTS,
    TRAINER_STATE,
    CheckpointError,
    load_adapter_weights,
    load_checkpoint,
    save_adapter,
)
from gpu_runtime.finetune.dpo_trainer import DpoTrainer
from gpu_runtime.finetune.lora import (
    adapter_parameters,
    adapter_state_dict,
    build_training_model,
    lora_config,
)
from gpu_runtime.finetune.loss import training_hidden_states
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.lora.errors import AdapterConfigError
from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM, build_random_model
from tests.gpu_runtime.distributed.ranks import run_ranks

CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=509)  # 4 heads, 2 KV heads
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPEC = LoraSpec(rank=4, alpha=8, dropout=0.0, target_modules=ALL)
SEQ = 10
DROPOUT = 0.1


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(SEQ).expand(2, SEQ)


def _examples() -> list[TokenizedExample]:
    generator = torch.Generator().manual_seed(7)
    examples = []
    for length in (9, 12, 7, 14, 10, 8, 11, 13):
        ids = torch.randint(0, CONFIG.vocab_size, (length,), generator=generator).tolist()
        labels = [-100] * 3 + ids[3:]
        examples.append(TokenizedExample(tuple(ids), tuple(labels)))
    return examples


def _hparams(dropout: float = 0.0) -> Any:
    return resolve_hyperparameters(
        n_train_examples=8,
        n_epochs=2,
        batch_size=4,
        learning_rate_multiplier=50.0,
        lora=dataclasses.replace(SPEC, dropout=dropout),
        seed=9,
        checkpoint_every_steps=2,
        max_grad_norm=0.02,
    )


def _dpo_curve(model: CausalLM) -> list[tuple[float, ...]]:
    """A DPO job's steps (loss, grad norm, preference metrics): 8 pairs of random rows."""
    generator = torch.Generator().manual_seed(11)
    pairs = []
    for length in (6, 8, 5, 9, 7, 6, 8, 5):
        prompt = torch.randint(0, CONFIG.vocab_size, (4,), generator=generator).tolist()
        rows = []
        for _ in range(2):
            answer = torch.randint(0, CONFIG.vocab_size, (length,), generator=generator).tolist()
            rows.append(TokenizedExample(tuple(prompt + answer), tuple([-100] * 4 + answer)))
        pairs.append(PreferencePair(rows[0], rows[1]))
    hparams = dataclasses.replace(_hparams(), n_epochs=1, dpo_beta=0.5)
    trainer = DpoTrainer(model, pairs, hparams)
    while not trainer.finished:
        trainer.step_quantum(max_examples=2)
    return [
        (step.loss, step.grad_norm, pref.chosen_reward, pref.rejected_reward)
        for step, pref in zip(trainer.history, trainer.preference_history, strict=True)
    ]


def _serving(parallel: TensorParallel) -> CausalLM:
    return build_random_model(CONFIG, seed=5, dtype="float32", parallel=parallel)


@torch.no_grad()
def _served_logits(model: CausalLM, adapter_dir: Path) -> tuple[MultiLoraRuntime, torch.Tensor]:
    """Row 0 with the adapter, row 1 without, through the engine's general LoRA forward."""
    runtime = MultiLoraRuntime(model, max_tokens=2 * SEQ, num_slots=2, max_rank=8)
    runtime.register("x", adapter_dir)
    runtime.attach("with", "x")
    assert runtime.set_batch([("with", SEQ), ("base", SEQ)])
    ids, positions = _inputs()
    return runtime, model.compute_logits(runtime.forward(ids, positions))


@torch.no_grad()
def _tree_logits(tree: CausalLM) -> torch.Tensor:
    ids, positions = _inputs()
    tree.eval()
    return tree.compute_logits(training_hidden_states(tree, ids, positions))


def _train(
    model: CausalLM,
    root: Path | None,
    fused: bool,
    dropout: float = 0.0,
    max_layers: int | None = None,
) -> LoraTrainer:
    """Train to the end in micro-batches of 2 examples (``max_layers``: layer-sliced quanta)."""
    hparams = _hparams(dropout)
    trainer = LoraTrainer(model, _examples(), hparams, checkpoint_root=root, fused_forward=fused)
    while not trainer.finished:
        trainer.step_quantum(max_examples=2, max_layers=max_layers)
    return trainer


def _curve(trainer: LoraTrainer) -> list[tuple[float, float]]:
    return [(record.loss, record.grad_norm) for record in trainer.history]


def _on_rank(parallel: TensorParallel, work: str, fused: bool) -> dict[str, Any]:
    """A rank's share of every check (see the module docstring)."""
    work_dir = Path(work)
    model = _serving(parallel)
    _, served = _served_logits(model, work_dir / "tp1-adapter")
    # at 4 ranks in layer-sliced quanta: the collectives of a micro-batch span several quanta
    max_layers = None if fused else 1
    trainer = _train(model, work_dir / f"tp{parallel.size}", fused, max_layers=max_layers)
    result: dict[str, Any] = {
        "served": served,
        "curve": _curve(trainer),
        "trained_logits": _tree_logits(trainer.model),
        "dropout_curve": _curve(_train(model, None, True, DROPOUT)),
        "dpo_curve": _dpo_curve(model),
    }
    resumed = LoraTrainer(
        model,
        _examples(),
        _hparams(),
        checkpoint_root=work_dir / f"resumed-tp{parallel.size}",
        fused_forward=fused,
    )
    load_checkpoint(resumed, work_dir / f"tp{parallel.size}" / "step-000002")
    while not resumed.finished:
        resumed.step_quantum(max_examples=2)
    result["resumed_curve"] = _curve(resumed)
    tree = build_training_model(model, SPEC, seed=0)
    load_adapter_weights(tree, work_dir / "tp1" / "step-000004")
    result["tp1_adapter_logits"] = _tree_logits(tree)
    result["refusals"] = _refusals(tree, work_dir / f"local-{parallel.size}-{parallel.rank}")
    return result


def _refusals(tree: CausalLM, directory: Path) -> list[str]:
    """What loading a file of this rank's slices (not whole tensors) raises, in a training
    tree and in serving."""
    directory.mkdir()
    (directory / "adapter_config.json").write_text(
        json.dumps(lora_config(SPEC).to_dict(), default=list)
    )
    local = {key: value.contiguous() for key, value in adapter_state_dict(tree).items()}
    save_file(local, str(directory / ADAPTER_WEIGHTS))
    errors = []
    for load in (
        lambda: load_adapter_weights(tree, directory),
        lambda: HostAdapter.from_directory("local", directory, CONFIG, shard=tree.shard),
    ):
        try:
            load()
            errors.append("loaded")
        except (CheckpointError, AdapterConfigError) as exc:
            errors.append(str(exc))
    return errors


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The one-GPU references, and the directory the ranks share."""
    work = tmp_path_factory.mktemp("tp-lora")
    tree = build_training_model(_serving(SINGLE), SPEC, seed=1)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for param in adapter_parameters(tree):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    save_adapter(tree, SPEC, work / "tp1-adapter")
    config_path = work / "tp1-adapter" / "adapter_config.json"
    raw = json.loads(config_path.read_text())
    raw.update(use_rslora=True, alpha_pattern={"o_proj": 24, r"model\.layers\.1\.mlp\.up_proj": 3})
    config_path.write_text(json.dumps(raw))
    model = _serving(SINGLE)
    _, served = _served_logits(model, work / "tp1-adapter")
    base = model.compute_logits(model(*_inputs()))
    curves = {}
    for fused in (True, False):
        trainer = _train(_serving(SINGLE), work / f"tp1-{fused}", fused)
        curves[fused] = _curve(trainer)
        if fused:
            (work / "tp1").symlink_to(work / f"tp1-{fused}")
            trained = _tree_logits(trainer.model)
    dropout_curve = _curve(_train(_serving(SINGLE), None, True, DROPOUT))
    return {
        "dpo_curve": _dpo_curve(_serving(SINGLE)),
        "dropout_curve": dropout_curve,
        "work": work,
        "served": served,
        "base": base,
        "curves": curves,
        "trained_logits": trained,
    }


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest, one_gpu: dict[str, Any]) -> tuple[int, list[Any]]:
    """Every rank's results at 2 ranks (fused training forward) and at 4 (the peft tree's, in
    layer-sliced quanta)."""
    size = request.param
    return size, run_ranks(size, _on_rank, str(one_gpu["work"]), size == 2)


def test_served_adapter_logits_equal_one_gpu(ranks: tuple[int, list[Any]], one_gpu: Any) -> None:
    _, results = ranks
    want = one_gpu["served"]
    assert not torch.allclose(want[0], one_gpu["base"][0], atol=1e-3)  # the adapter matters
    torch.testing.assert_close(want[1], one_gpu["base"][1], rtol=0, atol=1e-6)
    for result in results:
        torch.testing.assert_close(result["served"], want, rtol=1e-5, atol=1e-5)


def test_training_curve_equals_one_gpu(ranks: tuple[int, list[Any]], one_gpu: Any) -> None:
    size, results = ranks
    want = one_gpu["curves"][size == 2]
    assert len(want) == 4
    assert all(norm > _hparams().max_grad_norm for _, norm in want)  # clipping is active
    assert want[-1][0] < want[0][0]
    for result in results:
        got = torch.tensor(result["curve"], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=0)


def test_fused_training_with_dropout_equals_one_gpu(
    ranks: tuple[int, list[Any]], one_gpu: Any
) -> None:
    """The fused forward draws one GPU's dropout masks (a row-parallel input's drawn whole)."""
    _, results = ranks
    want = torch.tensor(one_gpu["dropout_curve"], dtype=torch.float64)
    assert not torch.allclose(want, torch.tensor(one_gpu["curves"][True], dtype=torch.float64))
    for result in results:
        got = torch.tensor(result["dropout_curve"], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_dpo_curve_equals_one_gpu(ranks: tuple[int, list[Any]], one_gpu: Any) -> None:
    """Loss, grad norm and rewards; a reward is beta times a difference of summed completion
    log-probabilities (about 60 each here), so its rounding is absolute, about 1e-5."""
    _, results = ranks
    want = torch.tensor(one_gpu["dpo_curve"], dtype=torch.float64)
    assert want.shape == (2, 4)
    for result in results:
        got = torch.tensor(result["dpo_curve"], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_saved_adapter_and_moments_are_one_gpu_s(
    ranks: tuple[int, list[Any]], one_gpu: Any
) -> None:
    """The TP checkpoint holds whole tensors (PEFT keys, one copy per KV head) equal to the
    one-GPU run's, and whole AdamW moments (to float rounding of the sums' order, which
    AdamW's division by the second moment's root grows where that is small)."""
    size, _ = ranks
    work = one_gpu["work"]
    reference = work / f"tp1-{size == 2}" / "step-000004"
    ours = work / f"tp{size}" / "step-000004"
    want, got = load_file(reference / ADAPTER_WEIGHTS), load_file(ours / ADAPTER_WEIGHTS)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4)
    state = torch.load(ours / TRAINER_STATE, weights_only=True)["optimizer"]["state"]
    reference_state = torch.load(reference / TRAINER_STATE, weights_only=True)["optimizer"]["state"]
    for index, moments in reference_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[index][key].shape == moments[key].shape
            torch.testing.assert_close(state[index][key], moments[key], rtol=1e-3, atol=1e-9)


def test_resume_at_the_same_degree_is_exact(ranks: tuple[int, list[Any]]) -> None:
    _, results = ranks
    for result in results:
        assert result["resumed_curve"] == result["curve"]


def test_adapter_trained_at_tp_serves_at_one_gpu(
    ranks: tuple[int, list[Any]], one_gpu: Any
) -> None:
    size, results = ranks
    final = one_gpu["work"] / f"tp{size}" / "step-000004"
    model = _serving(SINGLE)
    runtime = MultiLoraRuntime(model, max_tokens=2 * SEQ, num_slots=1, max_rank=8)
    runtime.register("trained", final)
    runtime.attach("a", "trained")
    runtime.attach("b", "trained")
    assert runtime.set_batch([("a", SEQ), ("b", SEQ)])
    with torch.no_grad():
        served = model.compute_logits(runtime.forward(*_inputs()))
    torch.testing.assert_close(served, results[0]["trained_logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0]["trained_logits"], results[-1]["trained_logits"])


def test_one_gpu_adapter_loads_into_a_tp_tree(ranks: tuple[int, list[Any]], one_gpu: Any) -> None:
    _, results = ranks
    for result in results:
        torch.testing.assert_close(
            result["tp1_adapter_logits"], one_gpu["trained_logits"], rtol=1e-5, atol=1e-5
        )


def test_a_file_of_one_rank_s_slices_is_refused(ranks: tuple[int, list[Any]]) -> None:
    """Files hold whole tensors: a rank's slices are refused by the trainer and by serving,
    naming the tensor, rather than loaded as a smaller adapter."""
    _, results = ranks
    for result in results:
        tree_error, serving_error = result["refusals"]
        assert "is not a whole tensor" in tree_error, tree_error
        assert "has shape" in serving_error and "expected" in serving_error, serving_error
