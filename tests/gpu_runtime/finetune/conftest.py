"""Fixtures: the tiny tokenizer and tiny random models, built locally (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.model.tiny import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(directory)
    return directory


@pytest.fixture()
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))
