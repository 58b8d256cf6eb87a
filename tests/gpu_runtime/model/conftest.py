"""Tiny model directories shared by the model tests (built once per session, no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_runtime.model.tiny import build_tiny_model_dir


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """Tiny matmuls run faster on one thread of the shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-qwen"), "qwen2", seed=2, max_shard_bytes=60_000
    )
