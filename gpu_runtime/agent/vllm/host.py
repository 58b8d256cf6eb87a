"""`VllmHost`: the agent's side of a vLLM host — its commands, adapters and reports.

- Commands (`gpu_runtime.contract.protocol`) run one at a time (`command`, any thread):
  `load_adapter` fetches the adapter's PEFT files from storage as the Harli host does
  (`HostAdapters.fetch_peft`, into `<work_dir>/adapters/<name>`) and loads them through vLLM's
  runtime LoRA API; a load vLLM refuses removes the copy and is reported as
  `adapter_load_failed`. `unload_adapter` unloads and removes the copy. `drain`/`undrain` set
  the heartbeat's `draining`. Placements, pauses and base-model changes are refused (logged):
  a vLLM host trains nothing and serves the model it started with; its heartbeat's
  `free_bytes` is 0, so the control plane places no job on it.
- After vLLM restarted (`VllmSupervisor.on_ready` → :meth:`reload_adapters`) every adapter
  served before is loaded again from its copy.
- :meth:`snapshot` scrapes `/metrics` (at most once per `min_scrape_s`) into the heartbeat's
  `HostSnapshot`; :meth:`metrics_report_fields` gives the interval's `metrics` report fields
  through `agent.reporting.deployment_metrics` (`vllm.figures` says how the figures map).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_runtime.agent.adapters import HostAdapters
from gpu_runtime.agent.config import HostCapabilities
from gpu_runtime.agent.predictor import HarvestEstimate
from gpu_runtime.agent.reporting import (
    HostSnapshot,
    ServingFigures,
    deployment_metrics,
    metrics_fields,
)
from gpu_runtime.agent.vllm.client import VllmApiError, VllmClient
from gpu_runtime.agent.vllm.figures import interval_metrics, serving_figures, ttft_requests
from gpu_runtime.agent.vllm.metrics import VllmScrape, parse_scrape
from gpu_runtime.agent.vllm.supervisor import VllmSupervisor
from gpu_runtime.contract.protocol import SERVING_WINDOW_S, report
from gpu_runtime.contract.storage import Storage

logger = logging.getLogger(__name__)
Send = Callable[[dict[str, Any]], None]
NO_HARVEST = HarvestEstimate(tokens_per_s=0.0, source="measured", mode="none")
IDLE_SERVING = ServingFigures(0, 0, 0, 0, 0, 0, (), None, None)


class VllmHost:
    """See the module docstring."""

    def __init__(
        self,
        *,
        host: str,
        base_model: str,
        supervisor: VllmSupervisor,
        client: VllmClient,
        storage: Storage,
        work_dir: Path,
        send: Send,
        capabilities: HostCapabilities,
        total_bytes: int,
        tpot_slo_ms: float,
        tensor_parallel_size: int = 1,
        min_scrape_s: float = 0.5,
    ) -> None:
        """`total_bytes`: one GPU's (each of the `tensor_parallel_size` GPUs vLLM shards the
        model over reports it, as `agent.reporting` does for a Harli host)."""
        self.host = host
        self.base_model = base_model
        self.supervisor = supervisor
        self.client = client
        self.adapters = HostAdapters(storage, work_dir)
        self.send = send
        self.capabilities = capabilities
        self.total_bytes = total_bytes
        self.tpot_slo_ms = tpot_slo_ms
        self.tensor_parallel_size = tensor_parallel_size
        self.min_scrape_s = min_scrape_s
        self.draining = False
        self._served: dict[str, Path] = {}
        """Adapters served, by name: replaced whole on a change (never changed in place), so
        the server's threads read it without a lock."""
        self._commands = threading.Lock()
        self._scrapes: deque[VllmScrape] = deque()
        self._last_metrics: VllmScrape | None = None
        supervisor.on_ready = self.reload_adapters

    # ---- commands -------------------------------------------------------------------------
    def command(self, command: dict[str, Any]) -> None:
        """Apply one host command (see the module docstring)."""
        name = command["command"]
        with self._commands:
            logger.info("handling %s %s", name, command.get("command_id"))
            if name == "load_adapter":
                self._load_adapter(str(command["name"]), str(command["storage_key"]))
            elif name == "unload_adapter":
                self._unload_adapter(str(command["name"]))
            elif name in ("drain", "undrain"):
                self.draining = name == "drain"
            elif name == "load_base_model" and command.get("base_model") == self.base_model:
                pass
            else:
                logger.error("a vLLM host does not apply %s (it serves %s and trains nothing)",
                             name, self.base_model)  # fmt: skip

    def _load_adapter(self, name: str, storage_key: str) -> None:
        if name in self._served:
            return
        try:
            directory = self.adapters.fetch_peft(name, storage_key)
        except (FileNotFoundError, OSError) as exc:
            self._load_failed(name, storage_key, str(exc))
            return
        try:
            self.client.load_lora(name, str(directory))
        except (VllmApiError, OSError) as exc:
            shutil.rmtree(directory, ignore_errors=True)
            self._load_failed(name, storage_key, str(exc))
            return
        self._served = {**self._served, name: directory}
        logger.info("serving adapter %s from %s", name, storage_key)

    def _load_failed(self, name: str, storage_key: str, message: str) -> None:
        logger.error("cannot serve adapter %s from %s: %s", name, storage_key, message)
        self.send(report("adapter_load_failed", self.host, name=name, storage_key=storage_key,
                         message=f"cannot serve {storage_key}: {message}"[:1000]))  # fmt: skip

    def _unload_adapter(self, name: str) -> None:
        if name not in self._served:
            return
        self._served = {k: v for k, v in self._served.items() if k != name}
        try:
            self.client.unload_lora(name)
        except (VllmApiError, OSError) as exc:
            logger.warning("vLLM did not unload %s: %s", name, exc)
        shutil.rmtree(self.adapters.directory(name), ignore_errors=True)
        logger.info("stopped serving %s", name)

    def reload_adapters(self) -> None:
        """Load every served adapter into a (restarted) vLLM again."""
        with self._commands:
            for name, directory in list(self._served.items()):
                try:
                    self.client.load_lora(name, str(directory))
                except (VllmApiError, OSError) as exc:
                    logger.error("adapter %s not reloaded after the vLLM restart: %s", name, exc)
                    self._served = {k: v for k, v in self._served.items() if k != name}

    def served_adapters(self) -> list[str]:
        """The adapters vLLM serves for this host now (any thread)."""
        return sorted(self._served)

    # ---- reports ----------------------------------------------------------------------------
    def engine_state(self) -> dict[str, Any]:
        """The supervisor's state and restart count (the heartbeat's `engine_state`)."""
        return {"state": self.supervisor.state, "restarts": self.supervisor.restarts}

    def scrape(self) -> VllmScrape | None:
        """A new scrape, kept for the serving window; None when vLLM does not answer."""
        now = time.monotonic()
        if self._scrapes and now - self._scrapes[-1].at < self.min_scrape_s:
            return self._scrapes[-1]
        try:
            scrape = parse_scrape(self.client.metrics_text(), now)
        except (VllmApiError, OSError, ValueError) as exc:
            logger.warning("no vLLM metrics (%s): %s", self.supervisor.state, exc)
            return None
        self._scrapes.append(scrape)
        while len(self._scrapes) > 1 and now - self._scrapes[1].at >= SERVING_WINDOW_S:
            self._scrapes.popleft()
        return scrape

    def snapshot(self) -> HostSnapshot:
        scrape = self.scrape()
        if scrape is None:
            serving = IDLE_SERVING
        else:
            start = self._scrapes[0] if self._scrapes[0] is not scrape else None
            serving = serving_figures(
                scrape,
                start,
                max_loras=self.capabilities.max_loras,
                tpot_slo_ms=self.tpot_slo_ms,
            )
        return HostSnapshot(
            base_model=self.base_model,
            placements=[],
            adapters=self.served_adapters(),
            free_bytes=0,
            total_bytes=self.total_bytes,
            harvest=NO_HARVEST,
            draining=self.draining,
            serving=serving,
            tensor_parallel_size=self.tensor_parallel_size,
            engine=self.capabilities.engine,
            capabilities={k: v for k, v in self.capabilities.as_dict().items() if k != "engine"},
            engine_state=self.engine_state(),
        )

    def metrics_report_fields(self) -> dict[str, Any] | None:
        """The `metrics` report's fields for the interval since the previous call (the first
        call opens it); None when vLLM did not answer or the interval is just opened."""
        scrape = self.scrape()
        if scrape is None:
            return None
        before, self._last_metrics = self._last_metrics, scrape
        if before is None:
            return None
        interval = interval_metrics(scrape, before, tpot_slo_ms=self.tpot_slo_ms)
        requests = ttft_requests(scrape, before, self.base_model)
        zeros = {"weights_bytes": 0, "kv_used_bytes": 0, "finetune_lent_bytes": 0,
                 "free_bytes": 0, "finetune_tokens_per_s": 0.0}  # fmt: skip
        return metrics_fields(
            window_s=interval.seconds,
            host_metrics=zeros,
            deployment_metrics=deployment_metrics(interval, requests, None, None, None),
            total_bytes=self.total_bytes,
            tensor_parallel_size=self.tensor_parallel_size,
        )
