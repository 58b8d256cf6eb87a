"""Fixtures: the tiny tokenizer and tiny random models, built locally (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.model.tiny import build_tiny_tokenizer
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(directory)
    return directory


@pytest.fixture()
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def train_lines() -> list[str]:
    """A small prompt/completion file whose answers a tiny LoRA can memorise."""
    import json

    pairs = [
        ("Q: colour of the sky?", " A: blue"),
        ("Q: the quick brown fox", " A: jumps over the lazy dog"),
        ("Q: hello", " A: world"),
        ("Q: numbers", " A: 1 2 3 4 5"),
        ("Q: paged attention stores", " A: keys and values in blocks"),
        ("Q: batching", " A: continuous, at every step"),
        ("Q: adapters", " A: low-rank"),
        ("Q: the sea", " A: a short poem about the sea and the sky"),
        ("Q: decode", " A: reads every weight once per step"),
        ("Q: once upon", " A: a time there was a small model"),
    ]
    return [json.dumps({"prompt": p, "completion": c}) for p, c in pairs]


@pytest.fixture()
def train_examples(tokenizer: Any, train_lines: list[str]) -> tuple[Any, ...]:
    from gpu_runtime.finetune.data import tokenize_lines

    return tokenize_lines(train_lines, tokenizer, max_seq_len=64).examples


@pytest.fixture()
def serving_model() -> Any:
    from gpu_runtime.model import build_random_model
    from gpu_runtime.model.tiny import tiny_config

    return build_random_model(tiny_config("llama"), seed=0, dtype="float32")


def cuda_serving_model(num_hidden_layers: int = 2) -> Any:
    """A small bf16 llama on CUDA with fused projections (as the decode engine keeps them)."""
    from gpu_runtime.model import build_random_model
    from gpu_runtime.model.tiny import tiny_config

    config = tiny_config(
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=num_hidden_layers,
    )
    model = build_random_model(config, seed=0, device="cuda", dtype="bfloat16")
    model.fuse_projections()
    return model
