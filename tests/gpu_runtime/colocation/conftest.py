"""Tiny model, tokenizer and LoRA examples for the co-location tests (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.model.tiny import build_tiny_tokenizer
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("colocation-tokenizer")
    build_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def train_examples(tokenizer_dir: Path) -> tuple[Any, ...]:
    from transformers import AutoTokenizer

    from gpu_runtime.finetune.data import tokenize_lines

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    pairs = [
        ("Q: colour of the sky?", " A: blue"),
        ("Q: the quick brown fox", " A: jumps over the lazy dog"),
        ("Q: hello", " A: world"),
        ("Q: numbers", " A: 1 2 3 4 5"),
        ("Q: paged attention stores", " A: keys and values in blocks"),
        ("Q: batching", " A: continuous, at every step"),
        ("Q: adapters", " A: low-rank"),
        ("Q: the sea", " A: a short poem about the sea and the sky"),
    ]
    lines = [json.dumps({"prompt": p, "completion": c}) for p, c in pairs]
    return tokenize_lines(lines, tokenizer, max_seq_len=64).examples
