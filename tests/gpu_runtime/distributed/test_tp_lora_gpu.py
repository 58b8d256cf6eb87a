"""CUDA, at least 2 GPUs: LoRA serving and training over NCCL ranks in bf16, the training
micro-batches replaying CUDA graphs that hold the finetune communicator's collectives.
Skipped on a machine with fewer GPUs; the multi-GPU runs take it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.contract.training_examples import TokenizedExample
from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.distributed.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

CONFIG = tiny_config(
    "llama",
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
)
SPEC = LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=("all-linear",))
SEQ = 32


def _serving(parallel: TensorParallel) -> CausalLM:
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_random_model(CONFIG, seed=0, device=device, dtype="bfloat16", parallel=parallel)
    model.fuse_projections()
    return model


def _examples() -> list[TokenizedExample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        ids = torch.randint(0, 480, (64,), generator=generator).tolist()
        out.append(TokenizedExample(tuple(ids), (-100, *ids[1:])))
    return out


def _run(parallel: TensorParallel, adapter_dir: str) -> dict[str, Any]:
    model = _serving(parallel)
    device = model.lm_head.weight.device
    runtime = MultiLoraRuntime(model, max_tokens=2 * SEQ, num_slots=2, max_rank=8)
    runtime.register("x", adapter_dir)
    runtime.attach("with", "x")
    assert runtime.set_batch([("with", SEQ), ("base", SEQ)])
    ids = torch.randint(0, 480, (2, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(SEQ, device=device).expand(2, SEQ)
    with torch.no_grad():
        served = model.compute_logits(runtime.forward(ids, positions)).float().cpu()
    hparams = resolve_hyperparameters(
        n_train_examples=8,
        n_epochs=2,
        batch_size=4,
        learning_rate_multiplier=20.0,
        lora=SPEC,
        warmup_ratio=0.0,
        seed=4,
    )
    trainer = LoraTrainer(model, _examples(), hparams)  # CUDA graphs on by default
    modes = []
    while not trainer.finished:
        modes.append(trainer.step_quantum(max_examples=2).graph)
    graphs = trainer.graphs
    assert graphs is not None
    return {
        "served": served,
        "curve": [(r.loss, r.grad_norm) for r in trainer.history],
        "modes": modes,
        "disabled": graphs.disabled,
    }


def test_tp2_lora_serving_and_graphed_training_equal_one_gpu(tmp_path: Path) -> None:
    tree = build_training_model(build_random_model(CONFIG, seed=0, dtype="float32"), SPEC, seed=1)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for param in adapter_parameters(tree):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    save_adapter(tree, SPEC, tmp_path / "adapter")
    want = _run(SINGLE, str(tmp_path / "adapter"))
    for got in run_ranks(2, _run, str(tmp_path / "adapter"), device="cuda"):
        assert got["disabled"] is None, got["disabled"]
        assert "replay" in got["modes"], got["modes"]
        torch.testing.assert_close(got["served"], want["served"], rtol=3e-2, atol=3e-2)
        assert len(got["curve"]) == len(want["curve"]) == 4
        for (loss, norm), (want_loss, want_norm) in zip(got["curve"], want["curve"], strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-2)
            assert norm == pytest.approx(want_norm, rel=5e-2)
