"""The host's `AdapterRegistry` for the operator's adapter routes (`gpu_runtime.server.
adapter_routes`): an adapter an operator loads from a directory under the agent's
`--adapter-root` is served at once beside the control plane's (same LoRA runtime, same batches),
from a private copy (`HostAdapters.load_directory`), and the next heartbeat names it.

The control plane treats it like any name a host serves: one it knows nothing about is left
alone, except a fine-tuned model's name (`ft:...`) that it deleted or never had, which it
unloads at the next heartbeat (`api.services.reports.heartbeat`). Loop thread only (the routes
call it through `EngineLoop.run_in_loop`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.server.adapter_admin import AdapterExistsError, check_fits_slots

if TYPE_CHECKING:
    from gpu_runtime.agent.runtime import HostRuntime


class OperatorAdapters:
    """Loads and unloads adapters by name on `runtime`'s engine (see the module docstring)."""

    def __init__(self, runtime: HostRuntime) -> None:
        self.runtime = runtime

    def load(self, name: str, directory: Path) -> None:
        lora = lora_runtime(self.runtime.engine)
        if lora.has(name):
            raise AdapterExistsError(f"The lora adapter '{name}' has already been loaded.")
        adapters = self.runtime.adapters
        clash = [n for n in lora.names() if adapters.directory(n) == adapters.directory(name)]
        if clash:
            raise AdapterExistsError(
                f"lora_name {name!r} would share the host's copy of the served {clash[0]!r}"
            )
        check_fits_slots(lora, directory)
        adapters.load_directory(lora, name, directory)
        self.runtime.refresh_status()

    def unload(self, name: str) -> bool:
        served = self.runtime.adapters.unload(lora_runtime(self.runtime.engine), name)
        self.runtime.refresh_status()
        return served
