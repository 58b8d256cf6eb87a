"""What the decode engine needs from a multi-adapter (LoRA) runtime, as a protocol.

:class:`gpu_runtime.lora.runtime.MultiLoraRuntime` implements it; the engine only calls these
methods, so it depends on the slot layout (:mod:`gpu_runtime.lora.groups`) and this contract,
not on how adapters are stored or loaded. Contract:

- `has(name)` / `names()`: the adapters that can be served (request validation, `/v1/models`).
- `can_admit(name)`: `attach` would succeed now (the adapter is resident in a GPU slot, or a slot
  is held by no request). `attach(request_id, name)` takes a slot reference for the request and
  returns the slot; `detach(request_id)` drops it (ignored for requests without an adapter).
- `set_batch(order)`: gives this step's tokens their slots, `order` = `(request_id, num_tokens)`
  in token order; returns True when some token uses an adapter.
- `forward(input_ids, positions, attention)`: hidden states like `CausalLM.forward`, plus the
  per-token LoRA terms of the last `set_batch`; tokens of requests without an adapter get exactly
  the base model's hidden states.
- `slot_of_request(request_id)`: the slot an attached request uses (-1: none); fixed while the
  request stays attached (a held slot is never evicted).
- `decode_groups()`: per layer, the stacked slots of each fused projection group (`LoraGroup`,
  keys in `GROUP_MODULES`), for the CUDA decode step that adds the LoRA terms inside its
  captured graph: the tensors are fixed storage written in place when slots change, so graphs
  stay valid; the per-row slots are a static input of the graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from gpu_runtime.lora.groups import LoraGroup
from gpu_runtime.model.attention import AttentionFn


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

    def slot_of_request(self, request_id: str) -> int: ...

    def decode_groups(self) -> Sequence[Mapping[str, LoraGroup]]: ...
