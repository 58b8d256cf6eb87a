"""A job's checkpoints served by their model names, loaded on demand.

A checkpoint's model name (`ft:<base>:<tenant>:<suffix>:<job id>:ckpt-step-<N>`, OpenAI's
`fine_tuned_model_checkpoint`) names its storage prefix (`protocol.checkpoint_key(job, N)`), so
the host needs no message to serve one: the first request allowed to call it
(`ModelAccess.allows_unlisted`: the gateway's grant names it, or, for a tenant's key, the control
plane answers `GET /v1/models/{name}` for that key) fetches its PEFT files and registers them
with the LoRA runtime. Checkpoints are loaded on demand rather than whenever one is written
because a job writes many and few are ever called: loading each on every host would fill the
hosts' adapter registries with weights nobody asked for. A checkpoint deleted or pruned is
unloaded by the control plane (`unload_adapter`, sent again while a heartbeat names it).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.contract.protocol import checkpoint_key, parse_checkpoint_model

if TYPE_CHECKING:
    from gpu_runtime.agent.runtime import HostRuntime
    from gpu_runtime.server import EngineLoop

logger = logging.getLogger(__name__)


class CheckpointModels:
    """The host server's `ModelLoader` (`gpu_runtime.server.inference`) for checkpoint names."""

    def __init__(self, loop: EngineLoop, runtime: HostRuntime, timeout_s: float = 60.0) -> None:
        self.loop = loop
        self.runtime = runtime
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one fetch at a time: a second caller finds it served

    def claims(self, name: str) -> bool:
        """Whether `name` is a checkpoint of a job on the base model this host serves."""
        parsed = parse_checkpoint_model(name)
        base = self.runtime.status().base_model
        return parsed is not None and parsed[0].startswith(f"ft:{base}:")

    def load(self, name: str) -> str | None:
        """Serve checkpoint `name` (blocking: fetch in the caller's thread, register on the
        loop thread); returns the adapter name, or None when no such checkpoint is stored."""
        parsed = parse_checkpoint_model(name)
        if parsed is None or not self.claims(name):
            return None
        _, job_id, step = parsed
        base = self.runtime.status().base_model
        with self._lock:
            if lora_runtime(self.runtime.engine).has(name):
                return name
            try:
                directory = self.runtime.adapters.fetch_peft(name, checkpoint_key(job_id, step))
            except FileNotFoundError:
                logger.info("checkpoint %s is not stored", name)
                return None
            served = self.loop.run_in_loop(
                lambda: self.runtime.serve_fetched(name, directory, base)
            ).result(timeout=self.timeout_s)
        if served:
            logger.info("serving checkpoint %s", name)
        return name if served else None
