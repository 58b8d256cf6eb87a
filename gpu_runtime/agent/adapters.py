"""Serving finished adapters by name on this host.

The decode engine does not apply per-request adapters yet, so each adapter gets its own small
`Engine` over a LoRA tree that shares the serving model's base tensors (built like the training
tree, put in eval mode, with the adapter's weights loaded): the base weights exist once; each
adapter adds only its LoRA tensors and its own KV cache. The engine loop steps these engines
right after each `HostLoop` iteration, on the same thread.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.finetune.checkpoint import load_adapter_weights, read_adapter
from gpu_runtime.finetune.lora import build_training_model
from gpu_runtime.model import CausalLM
from gpu_runtime.storage import Storage


def _directory_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _keep_projections() -> None:
    """Stands in for `CausalLM.fuse_projections` on adapter trees (see `load_local`)."""


class AdapterEngines:
    """Adapter name -> decode engine (see the module docstring). Owned by the loop thread."""

    def __init__(
        self,
        serving_model: CausalLM,
        engine_config: EngineConfig,
        tokenizer: Any,
        storage: Storage,
        work_dir: Path,
        kv_blocks_per_adapter: int,
    ) -> None:
        self.serving_model = serving_model
        self.engine_config = replace(engine_config, num_kv_blocks=kv_blocks_per_adapter)
        self.tokenizer = tokenizer
        self.storage = storage
        self.work_dir = Path(work_dir) / "adapters"
        self._engines: dict[str, Engine] = {}

    def names(self) -> list[str]:
        return sorted(self._engines)

    def get(self, name: str) -> Engine | None:
        return self._engines.get(name)

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def load_local(self, name: str, directory: Path) -> None:
        """Serve the PEFT adapter in `directory` as `name` (a second load is a no-op)."""
        if name in self._engines:
            return
        spec, _ = read_adapter(directory)
        tree = build_training_model(self.serving_model, spec, seed=0)
        load_adapter_weights(tree, directory)
        tree.eval()
        for param in tree.parameters():
            param.requires_grad_(False)
        # The engine fuses q/k/v and gate/up into single GEMMs, which would bypass the LoRA
        # layers: this tree keeps its per-projection modules (a no-op fuse on this instance).
        object.__setattr__(tree, "fuse_projections", _keep_projections)
        self._engines[name] = Engine(tree, self.engine_config, tokenizer=self.tokenizer)

    def load(self, name: str, storage_key: str) -> None:
        """Fetch `storage_key` (an adapter tree) from storage and serve it as `name`."""
        if name in self._engines:
            return
        directory = self.work_dir / _directory_name(name)
        shutil.rmtree(directory, ignore_errors=True)
        self.storage.get_tree(storage_key, directory)
        self.load_local(name, directory)
