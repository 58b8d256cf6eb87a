"""The reference tier's model directories (a tiny Llama and a tiny Qwen2, each with a random
rank-4 LoRA adapter) and its two servers. vLLM's server runs only where its virtual environment
exists (`scripts/vllm_env.sh`); elsewhere every test that needs it skips, naming the missing
environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_runtime.model.tiny import build_tiny_model_dir
from tests.gpu_runtime.agent.host_server import random_adapter
from tests.reference.servers import (
    HARLI_ENV,
    VLLM_ENV,
    VLLM_VENV_ENV,
    free_port,
    harli_argv,
    serve,
    vllm_argv,
    vllm_python,
)

VLLM_SKIP_ENV = "HARLI_TEST_VLLM_SKIP"
"""Set (by scripts/test.sh) to why the vLLM tier does not run here: its tests skip, saying so."""
ADAPTER = "acme"
ARCHITECTURES = ("llama", "qwen2")
Model = tuple[str, Path, dict[str, Path]]
"""Architecture, model directory, adapters by name."""


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """The tiny model of one architecture, head_dim 32 (vLLM's CPU attention has no kernel
    for the tiny preset's 16), fp32, with one adapter."""
    root = tmp_path_factory.mktemp(f"reference-{request.param}")
    model_dir = build_tiny_model_dir(
        root / "model",
        request.param,
        seed=3,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    return request.param, model_dir, {ADAPTER: random_adapter(model_dir, root / ADAPTER, seed=5)}


@pytest.fixture(scope="module")
def harli_url(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m gpu_runtime.server` on the model."""
    _, model_dir, adapters = model
    port = free_port()
    log = tmp_path_factory.mktemp("harli-log") / "server.log"
    with serve(harli_argv(model_dir, adapters, port), log, HARLI_ENV, port, 120) as url:
        yield url


@pytest.fixture(scope="module")
def vllm_url(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server on the model; skips where the vLLM environment is absent."""
    reason = os.environ.get(VLLM_SKIP_ENV)
    if reason:
        pytest.skip(f"vLLM reference tier skipped: {reason}")
    python = vllm_python()
    if not python.exists():
        pytest.skip(
            f"vLLM reference tier skipped: no vLLM environment at {python.parent.parent} "
            f"(scripts/vllm_env.sh builds it; {VLLM_VENV_ENV} points elsewhere)"
        )
    _, model_dir, adapters = model
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    with serve(vllm_argv(model_dir, adapters, port), log, VLLM_ENV, port, 300) as url:
        yield url
