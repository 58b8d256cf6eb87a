"""Finished adapters (and checkpoints) served by name on this host.

An adapter is registered with the engine's LoRA runtime (`engine.lora`), so its requests run
in the same decode batches as base-model requests over the one copy of the base weights (see
`gpu_runtime/engine/README.md`, Adapters). The runtime reads the adapter directory again when it
reloads an adapter evicted from host memory, so every adapter keeps a private copy under
`<work_dir>/adapters/<name>`. Loop thread only, except :meth:`HostAdapters.fetch_peft`
(files only; the caller registers the result on the loop thread).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from gpu_runtime.contract.storage import COMPLETE_MARKER, Storage
from gpu_runtime.finetune.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from gpu_runtime.lora.runtime import MultiLoraRuntime


def _directory_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _register(lora: MultiLoraRuntime, name: str, directory: Path) -> None:
    """Register `directory` as `name`; a refused adapter (the runtime's registry is left as it
    was) leaves no copy behind either."""
    try:
        lora.register(name, directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


class HostAdapters:
    """Fetches adapters (storage or a local directory) and registers them (idempotent)."""

    def __init__(self, storage: Storage, work_dir: Path) -> None:
        self.storage = storage
        self.root = Path(work_dir) / "adapters"

    def directory(self, name: str) -> Path:
        """Where `name`'s private copy lives (names differing only in characters a file name
        cannot hold share one)."""
        return self.root / _directory_name(name)

    def _target(self, name: str) -> Path:
        directory = self.directory(name)
        shutil.rmtree(directory, ignore_errors=True)
        directory.parent.mkdir(parents=True, exist_ok=True)
        return directory

    def load(self, lora: MultiLoraRuntime, name: str, storage_key: str) -> None:
        """Fetch `storage_key` (an adapter tree) from storage and serve it as `name`. On an
        error (no complete tree, not an adapter for this model) the fetched copy is removed
        and the error propagates."""
        if lora.has(name):
            return
        directory = self._target(name)
        try:
            self.storage.get_tree(storage_key, directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # what a failed fetch left
            raise
        _register(lora, name, directory)

    def load_local(self, lora: MultiLoraRuntime, name: str, source: Path) -> None:
        """Serve the PEFT adapter in `source` as `name` (from a copy of it)."""
        if lora.has(name):
            return
        directory = self._target(name)
        shutil.copytree(source, directory)
        _register(lora, name, directory)

    def load_directory(self, lora: MultiLoraRuntime, name: str, source: Path) -> None:
        """Serve the PEFT adapter in `source` (an operator's directory) as `name`, from a copy
        of its config and weights only: the operator's directory may change or go later.
        `name` must not be served (the caller checks); on any error nothing is left (no copy,
        no registration) and the error propagates."""
        directory = self._target(name)
        directory.mkdir()
        try:
            for file_name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                if not (source / file_name).is_file():
                    raise FileNotFoundError(f"{source} lacks {file_name}")
                shutil.copyfile(source / file_name, directory / file_name)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        _register(lora, name, directory)

    def fetch_peft(self, name: str, storage_key: str) -> Path:
        """Copy only the PEFT files (config and weights) of the tree at `storage_key` (a
        checkpoint also holds trainer state, which serving does not read) into `name`'s
        directory; FileNotFoundError when no complete tree is stored there."""
        if not self.storage.exists(f"{storage_key}/{COMPLETE_MARKER}"):
            raise FileNotFoundError(f"no complete tree stored under {storage_key!r}")
        directory = self._target(name)
        directory.mkdir()
        for file_name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            chunks = self.storage.read_chunks(f"{storage_key}/{file_name}")
            with (directory / file_name).open("wb") as out:
                for chunk in chunks:
                    out.write(chunk)
        return directory

    def register(self, lora: MultiLoraRuntime, name: str, directory: Path) -> None:
        """Serve the PEFT directory `directory` (from :meth:`fetch_peft`) as `name`."""
        if not lora.has(name):
            _register(lora, name, directory)

    def unload(self, lora: MultiLoraRuntime, name: str) -> bool:
        """Stop serving `name` (see `MultiLoraRuntime.unregister`) and drop its copy; False
        when it was not served."""
        served = lora.unregister(name)
        shutil.rmtree(self.root / _directory_name(name), ignore_errors=True)
        return served

    def forget(self) -> None:
        """Drop every fetched copy (the base model changed: they no longer apply)."""
        shutil.rmtree(self.root, ignore_errors=True)
