"""The agent's inference server over a test host (`conftest.make_runtime`, host "h1"), as
`run_agent` wires it, and grants the gateway would sign for it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.agent.checkpoint_models import CheckpointModels
from gpu_runtime.agent.config import AgentConfig
from gpu_runtime.agent.host_auth import host_auth
from gpu_runtime.contract.grants import GRANT_HEADER, Grant, grant_sign, host_key
from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.model.loader import load_model
from gpu_runtime.server import create_app
from tests.gpu_runtime.server.serving import serve_in_thread

HOST = "h1"
KEY = host_key("fleet-secret", HOST)
UNREACHABLE = "http://127.0.0.1:9"


def grant(*models: str, request_id: str = "gw-1") -> dict[str, str]:
    """The headers of a request the gateway granted `models` on this host for a minute."""
    signed = grant_sign(Grant(HOST, "acme", models, time.time() + 60, request_id), KEY)
    return {GRANT_HEADER: signed}


def agent_config(tmp_path: Path, **settings: Any) -> AgentConfig:
    """The agent's settings for host h1: its key, and a control plane nobody listens at."""
    fields: dict[str, Any] = {"host_key": KEY, "control_url": UNREACHABLE} | settings
    return AgentConfig(
        host=HOST,
        broker_url="memory://",
        storage=str(tmp_path / "storage"),
        work_dir=tmp_path / "work",
        base_model="tiny",
        **fields,
    )


@contextmanager
def agent_server(host: Any, config: AgentConfig) -> Iterator[str]:
    """The agent's app over `host` (a started `conftest.Host`), authenticating as `config`
    says, under uvicorn; yields its `/v1` URL."""
    loader = CheckpointModels(host.loop, host.runtime)
    auth = host_auth(config)
    app = create_app(host.loop, "tiny", auth, model_loader=loader, limits=config.request_limits())
    with serve_in_thread(app) as url:
        yield url


def random_adapter(model_dir: Path, target: Path, seed: int) -> Path:
    """A rank-4 PEFT adapter of the model in `model_dir` with random (non-zero) A and B."""
    spec = LoraSpec(rank=4, alpha=8)
    tree = build_training_model(load_model(model_dir), spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_parameters(tree):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    save_adapter(tree, spec, target)
    return target
