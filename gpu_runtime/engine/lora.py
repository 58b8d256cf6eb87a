"""What the engine needs from a multi-adapter (LoRA) runtime, as a protocol.

`gpu_runtime.finetune.lora_serving.MultiLoraRuntime` implements it; the engine only calls these
methods, so it does not import the finetune package. Contract:

- `has(name)` / `names()`: the adapters that can be served (request validation, `/v1/models`).
- `can_admit(name)`: `attach` would succeed now (the adapter is resident in a GPU slot, or a slot
  is held by no request). `attach(request_id, name)` takes a slot reference for the request and
  returns the slot; `detach(request_id)` drops it (ignored for requests without an adapter).
- `set_batch(order)`: gives this step's tokens their slots, `order` = `(request_id, num_tokens)`
  in token order; returns True when some token uses an adapter.
- `forward(input_ids, positions, attention)`: hidden states like `CausalLM.forward`, plus the
  per-token LoRA terms of the last `set_batch`; tokens of requests without an adapter get exactly
  the base model's hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from gpu_runtime.model.llama import AttentionFn


class LoraForward(Protocol):
    """`(input_ids [T], positions [T], attention) -> hidden [T, hidden_size]`."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn | None = ...
    ) -> torch.Tensor: ...


class LoraRuntime(Protocol):
    """Adapters by name for one serving model (see the module docstring)."""

    @property
    def forward(self) -> LoraForward: ...

    def has(self, name: str) -> bool: ...

    def names(self) -> list[str]: ...

    def can_admit(self, name: str) -> bool: ...

    def attach(self, request_id: str, name: str) -> int: ...

    def detach(self, request_id: str) -> None: ...

    def set_batch(self, order: Sequence[tuple[str, int]]) -> bool: ...
