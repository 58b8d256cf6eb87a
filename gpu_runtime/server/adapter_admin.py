"""What the operator's adapter routes (`adapter_routes`) need: the operator credential, the
directories an adapter may be loaded from, and the registry that loads and unloads adapters.

`AdapterAdmin` is validated at construction (a non-empty token, existing absolute roots). Its
:meth:`AdapterAdmin.resolve` turns a request's `lora_path` into a directory under one of the
roots, symlinks resolved, so the load route reads nothing outside them. An `AdapterRegistry`
runs on the engine loop thread (`EngineLoop.run_in_loop`), between steps, where the LoRA
runtime may change: a stand-alone server's is `EngineAdapters` (the engine's own runtime); a
host agent's keeps private copies and refreshes its heartbeat (`gpu_runtime.agent`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gpu_runtime.engine import Engine
from gpu_runtime.finetune.checkpoint import CheckpointError
from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.runtime import MultiLoraRuntime

ADMIN_TOKEN_ENV = "HARLI_HOST_ADMIN_TOKEN"
"""The environment variable holding the operator token (never an option: never on a command
line)."""
ADAPTER_LOAD_ERRORS: tuple[type[Exception], ...] = (ValueError, KeyError, OSError, CheckpointError)
"""What a bad adapter directory raises when it is registered (missing or unreadable files, a
config that is not LoRA or names no rank, tensors that do not fit the model, an adapter kind
the runtime does not serve): answered as a 400 naming `lora_path`."""


class AdapterAdminError(ValueError):
    """An invalid `AdapterAdmin` setting; the message names it and its value."""


class AdapterExistsError(ValueError):
    """An adapter is already served under the name asked for."""


def check_fits_slots(lora: MultiLoraRuntime, directory: Path) -> None:
    """ValueError when the adapter in `directory` cannot take one of `lora`'s GPU slots: a
    rank above theirs or a module they do not hold (checked at load, so an operator's load
    fails at once instead of every request for it later); the reading itself raises the
    LoRA runtime's own refusals (`gpu_runtime.lora.errors`)."""
    weights = lora.weights
    adapter = HostAdapter.from_directory(directory.name, directory, weights.config)
    if adapter.rank > weights.max_rank:
        raise ValueError(f"adapter rank {adapter.rank} > the server's largest, {weights.max_rank}")
    extra = sorted(adapter.projections - set(weights.target_modules))
    if extra:
        raise ValueError(f"adapter targets {extra}, which this server's slots do not hold")


class AdapterRegistry(Protocol):
    """Loads and unloads adapters by name. Loop thread only."""

    def load(self, name: str, directory: Path) -> None:
        """Serve the PEFT LoRA adapter in `directory` as `name`: AdapterExistsError when
        `name` is served, one of :data:`ADAPTER_LOAD_ERRORS` for a bad adapter (nothing
        changes then)."""
        ...

    def unload(self, name: str) -> bool:
        """Stop serving `name` (requests already running with it finish); False when it was
        not served."""
        ...


class EngineAdapters:
    """The registry over an engine's LoRA runtime (`engine.lora`, read on each call: the
    engine may be replaced), which reads the adapter from `directory` when it registers it and
    again when it reloads one evicted from host memory."""

    def __init__(self, engine: Callable[[], Engine]) -> None:
        self._engine = engine

    def _lora(self) -> MultiLoraRuntime:
        lora = self._engine().lora
        if not isinstance(lora, MultiLoraRuntime):
            raise ValueError("this server has no LoRA runtime that loads adapters")
        return lora

    def load(self, name: str, directory: Path) -> None:
        lora = self._lora()
        if lora.has(name):
            raise AdapterExistsError(f"The lora adapter '{name}' has already been loaded.")
        check_fits_slots(lora, directory)
        lora.register(name, directory)

    def unload(self, name: str) -> bool:
        return self._lora().unregister(name)


@dataclass(frozen=True)
class AdapterAdmin:
    """The operator side of one app: who may load adapters, and from where."""

    token: str = field(repr=False)
    """Bearer token of the operator routes (`Authorization: Bearer <token>`); tenants' keys
    and the gateway's grants never open them."""
    roots: tuple[Path, ...]
    """Directories an adapter may be loaded from (absolute, existing); a `lora_path` resolves
    under one of them or is refused."""
    registry: AdapterRegistry

    def __post_init__(self) -> None:
        if not self.token or self.token != self.token.strip():
            raise AdapterAdminError("the admin token must be non-empty, without spaces around")
        if not self.roots:
            raise AdapterAdminError("at least one adapter root is needed")
        for root in self.roots:
            if not root.is_absolute() or not root.is_dir():
                raise AdapterAdminError(f"adapter root {str(root)!r} is not an absolute directory")

    def resolve(self, lora_path: str) -> Path:
        """The directory `lora_path` names, symlinks resolved: absolute, or relative to the
        first root. ValueError (the message names the path) when it is not a directory under
        a root."""
        path = Path(lora_path)
        candidate = (path if path.is_absolute() else self.roots[0] / path).resolve()
        if not any(candidate.is_relative_to(root.resolve()) for root in self.roots):
            raise ValueError(f"lora_path {lora_path!r} is not under an adapter root")
        if not candidate.is_dir():
            raise ValueError(f"lora_path {lora_path!r} is not a directory")
        return candidate
