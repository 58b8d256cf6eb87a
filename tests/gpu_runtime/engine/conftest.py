"""Tiny models shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import build_tiny_model_dir, tiny_config
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401


@pytest.fixture(scope="session")
def tiny_llama() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-engine"), "llama", seed=5)
