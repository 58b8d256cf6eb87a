"""Tiny model directories shared by the model tests (built once per session, no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.model.tiny import build_tiny_model_dir
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-qwen"), "qwen2", seed=2, max_shard_bytes=60_000
    )
