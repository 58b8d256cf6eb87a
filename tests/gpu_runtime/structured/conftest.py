"""The tiny model with its byte-level BPE tokenizer (it spells JSON byte by byte), shared by the
structured-output tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.model.tiny import build_tiny_model_dir
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-structured"), "llama", seed=5)
