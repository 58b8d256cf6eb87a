"""Tiny models shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import build_tiny_model_dir, tiny_config


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """Tiny matmuls run faster on one thread of the shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_llama() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-engine"), "llama", seed=5)
