"""The assembly of an `--engine vllm` host: vLLM under its supervisor, the `VllmHost`, and the
pass-through server the gateway reaches (`proxy`), started and stopped in order.

vLLM listens on 127.0.0.1 (`--vllm-port`, else a free port) with a random API key; the
agent's server (`--listen`) is the host's inference URL in its heartbeat and checks the
gateway's grant before passing a request on. On a CPU device `VLLM_CPU_KVCACHE_SPACE`
defaults to 1 (GiB) unless the environment sets it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.agent.config import AgentConfig, AgentConfigError
from gpu_runtime.agent.host_auth import host_auth
from gpu_runtime.agent.vllm.client import VllmClient
from gpu_runtime.agent.vllm.host import VllmHost
from gpu_runtime.agent.vllm.proxy import create_proxy_app
from gpu_runtime.agent.vllm.supervisor import VllmLaunch, VllmSupervisor
from gpu_runtime.contract.storage import open_storage
from gpu_runtime.server.threaded import ThreadedServer, free_port

logger = logging.getLogger(__name__)
Send = Callable[[dict[str, Any]], None]
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"


def model_architectures(model_dir: Path) -> tuple[str, ...]:
    """The `architectures` of the model directory's `config.json` (empty when unreadable)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    return tuple(str(a) for a in config.get("architectures") or ())


def vllm_launch(config: AgentConfig, api_key: str) -> VllmLaunch:
    """How the host runs vLLM (see `AgentConfig`'s vLLM settings)."""
    assert config.model_dir is not None and config.vllm_bin is not None  # AgentConfig checks
    env: tuple[tuple[str, str], ...] = ()
    if config.device == "cpu" and CPU_KV_ENV not in os.environ:
        env = ((CPU_KV_ENV, "1"),)
    return VllmLaunch(
        executable=config.vllm_bin,
        model_dir=config.model_dir,
        served_name=config.base_model,
        port=config.vllm_port or free_port(),
        api_key=api_key,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_loras=config.lora_slots,
        max_lora_rank=config.lora_max_rank,
        max_num_seqs=config.max_num_seqs,
        extra_args=config.vllm_args,
        env=env,
    )


@dataclass
class VllmHostParts:
    """A started vLLM host; `stop()` ends its parts in reverse order."""

    supervisor: VllmSupervisor
    host: VllmHost
    server: ThreadedServer
    server_url: str
    commands: ThreadPoolExecutor

    def submit(self, command: dict[str, Any]) -> None:
        """Apply `command` on the host's command thread (failures logged)."""

        def apply() -> None:
            try:
                self.host.command(command)
            except Exception:
                logger.exception("host command %s failed", command.get("command"))

        self.commands.submit(apply)

    def stop(self) -> None:
        self.server.stop()
        self.commands.shutdown(wait=True)
        self.supervisor.stop()


def start_vllm_host(config: AgentConfig, send: Send, total_bytes: int) -> VllmHostParts:
    """Start vLLM (VllmStartError, its log quoted, when it does not become healthy), then the
    host and its server."""
    if config.engine != "vllm":
        raise AgentConfigError(f"start_vllm_host needs engine 'vllm', got {config.engine!r}")
    config.work_dir.mkdir(parents=True, exist_ok=True)
    api_key = secrets.token_urlsafe(24)
    launch = vllm_launch(config, api_key)
    supervisor = VllmSupervisor(
        launch, config.work_dir / "vllm", ready_timeout_s=config.vllm_ready_timeout_s
    )
    assert config.model_dir is not None
    host = VllmHost(
        host=config.host,
        base_model=config.base_model,
        supervisor=supervisor,
        client=VllmClient(launch.url, api_key),
        storage=open_storage(config.storage),
        work_dir=config.work_dir,
        send=send,
        capabilities=config.capabilities(model_architectures(config.model_dir)),
        total_bytes=total_bytes,
        tpot_slo_ms=config.tpot_slo_ms,
        tensor_parallel_size=config.vllm_tensor_parallel_size(),
    )
    supervisor.start()
    try:
        app = create_proxy_app(
            launch.url,
            api_key,
            host_auth(config),
            lambda: {config.base_model, *host.served_adapters()},
        )
        server = ThreadedServer(app, config.server_host, config.server_port)
        server.start()
    except BaseException:
        supervisor.stop()
        raise
    commands = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-host-commands")
    url = config.advertise_url or server.url
    logger.info("vLLM host %s: %s behind %s (%s)", config.host, launch.url, url,
                host.capabilities.as_dict())  # fmt: skip
    return VllmHostParts(supervisor, host, server, url, commands)
