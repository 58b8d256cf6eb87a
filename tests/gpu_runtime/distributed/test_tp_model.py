"""Tensor-parallel model shards on CPU (gloo, world sizes 2 and 4): logits equal one GPU's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.model import build_random_model, load_model, save_model
from tests.gpu_runtime.distributed.ranks import run_ranks

TINY = ModelConfig.preset("tiny")  # 4 query heads, 2 KV heads
SHAPES = {
    # KV heads split at 2, replicated at 4; a vocabulary that does not divide by 4.
    "llama": dataclasses.replace(TINY, vocab_size=509),
    # Qwen2: q/k/v biases; tied embeddings.
    "qwen2": dataclasses.replace(
        TINY, architecture="qwen2", attention_bias=True, tie_word_embeddings=True
    ),
    # Llama with attention_bias: an o bias, added once over the ranks.
    "llama-bias": dataclasses.replace(TINY, attention_bias=True, num_hidden_layers=3),
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(11).expand(2, 11)


def _logits_of_loaded(parallel: TensorParallel, directories: list[str]) -> list[torch.Tensor]:
    ids, positions = _inputs()
    out = []
    for directory in directories:
        model = load_model(directory, parallel=parallel)
        with torch.no_grad():
            out.append(model.compute_logits(model(ids, positions)))
    return out


def _logits_of_random(parallel: TensorParallel, config: ModelConfig) -> torch.Tensor:
    model = build_random_model(config, seed=5, parallel=parallel)
    ids, positions = _inputs()
    with torch.no_grad():
        return model.compute_logits(model(ids, positions))


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_load_gives_the_one_gpu_logits(tmp_path: Path, size: int) -> None:
    """Each rank reads its slices of the checkpoint; every shape's logits equal one GPU's."""
    directories, expected = [], []
    ids, positions = _inputs()
    for shape in sorted(SHAPES):
        whole = build_random_model(SHAPES[shape], seed=1)
        save_model(whole, tmp_path / shape)
        directories.append(str(tmp_path / shape))
        with torch.no_grad():
            expected.append(whole.compute_logits(whole(ids, positions)))
    for per_shape in run_ranks(size, _logits_of_loaded, directories):
        for logits, want in zip(per_shape, expected, strict=True):
            assert logits.shape == want.shape
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_random_shards_are_the_one_gpu_model_s() -> None:
    config = SHAPES["llama"]
    whole = build_random_model(config, seed=5)
    ids, positions = _inputs()
    with torch.no_grad():
        expected = whole.compute_logits(whole(ids, positions))
    ranks = run_ranks(2, _logits_of_random, config)
    for logits in ranks:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ranks[0], ranks[1])  # every rank holds the same full row
