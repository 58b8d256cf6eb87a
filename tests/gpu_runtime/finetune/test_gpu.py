"""The finetune engine on CUDA in bf16 (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM
from tests.gpu_runtime.finetune.conftest import cuda_serving_model

pytestmark = pytest.mark.gpu


def _serving() -> CausalLM:
    model: CausalLM = cuda_serving_model()
    return model


def _examples(count: int, seq: int) -> list[TokenizedExample]:
    ids = torch.randint(0, 480, (count, seq), generator=torch.Generator().manual_seed(0)).tolist()
    return [TokenizedExample(tuple(r), (IGNORE_INDEX, *r[1:])) for r in ids]


def test_trainer_runs_bf16_on_cuda_and_paths_agree() -> None:
    serving = _serving()
    examples = _examples(8, 64)
    hparams = resolve_hyperparameters(
        n_train_examples=8, n_epochs=1, batch_size=4, lora=LoraSpec(rank=8, dropout=0.0)
    )
    fused = LoraTrainer(serving, examples, hparams)
    plain = LoraTrainer(serving, examples, hparams, fused_forward=False)
    sliced = LoraTrainer(serving, examples, hparams)
    first = fused.step_quantum(max_examples=2)
    assert first.peak_memory_bytes is not None and first.peak_memory_bytes > 0
    reference = plain.step_quantum(max_examples=2)
    assert first.loss is not None and reference.loss is not None
    assert abs(first.loss - reference.loss) < 1e-2 * reference.loss
    while not fused.finished:
        fused.step_quantum(max_examples=2)
    while not sliced.finished:
        sliced.step_quantum(max_examples=2, max_layers=1)
    for a, b in zip(fused.history, sliced.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-3)


@torch.no_grad()
def test_multi_lora_graph_replay_matches_eager(tmp_path: Path) -> None:
    serving = _serving()
    spec = LoraSpec(rank=8, alpha=16, target_modules=("all-linear",))
    tree = build_training_model(serving, spec, seed=0)
    for p in adapter_parameters(tree):
        p.normal_(0, 0.05)
    save_adapter(tree, spec, tmp_path / "x")
    runtime = MultiLoraRuntime(serving, max_tokens=8, num_slots=2, max_rank=8)
    runtime.register("x", tmp_path / "x")
    runtime.attach("r1", "x")
    ids = torch.randint(0, 480, (4, 1), device="cuda")
    positions = torch.full((4, 1), 5, device="cuda")
    assert runtime.set_batch([("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1)])
    eager = serving.compute_logits(runtime.forward(ids, positions))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        serving.compute_logits(runtime.forward(ids, positions))
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = serving.compute_logits(runtime.forward(ids, positions))
    graph.replay()
    torch.testing.assert_close(captured, eager)
    base = serving.compute_logits(serving(ids, positions))
    torch.testing.assert_close(eager[0], base[0], rtol=2e-2, atol=2e-2)
    assert (eager[1].float() - base[1].float()).abs().max() > 1e-2  # the adapter row differs
    runtime.set_batch([("r1", 1), ("r0", 1), ("r2", 1), ("r3", 1)])  # in place: graph sees it
    graph.replay()
    swapped = serving.compute_logits(runtime.forward(ids, positions))
    torch.testing.assert_close(captured, swapped)
    torch.testing.assert_close(captured[1], base[1], rtol=2e-2, atol=2e-2)  # row 1: base now
