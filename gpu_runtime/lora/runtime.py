"""What a decode engine holds to serve finished adapters by name beside base-model requests.

:class:`MultiLoraRuntime` bundles the GPU slots (:class:`StackedLoraWeights`), the registry and
host LRU (:class:`AdapterManager`) and the forward pass that adds the per-token LoRA term to the
serving model's own computation (:class:`MultiLoraForward`). The engine:

1. asks :meth:`has` to validate a request's ``lora_name`` and :meth:`names` for ``/v1/models``;
2. admits a waiting request with an adapter only when :meth:`can_admit` is true, then
   :meth:`attach` es it (takes a slot reference); :meth:`detach` on finish, abort or preemption;
3. per step calls :meth:`set_batch` with the step's ``(request_id, num_tokens)`` in token order
   (padding tokens of a graph bucket as a request without adapter); when it returns True (some
   token uses an adapter) it computes ``hidden = runtime.forward(ids, positions, attention)``
   (same signature and attention objects as ``CausalLM.forward``) instead of
   ``model(ids, positions, attention)``, then ``model.compute_logits(hidden)`` as usual.

Under tensor parallelism each rank holds one runtime over its shard of the serving model: the
slots hold each adapter's slice (:mod:`gpu_runtime.lora.stacked`) and every rank must make the
same calls in the same order (the engine's followers mirror rank 0's), so a request has the
same slot on every rank.

On CUDA the engine's decode steps instead read :meth:`decode_groups` (the stacked slots) and
:meth:`slot_of_request` and add the LoRA terms inside the fused, graph-captured decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from gpu_runtime.contract.hparams import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from gpu_runtime.lora.adapter_store import AdapterManager, UnknownAdapterError
from gpu_runtime.lora.forward import MultiLoraForward
from gpu_runtime.lora.groups import LoraGroup
from gpu_runtime.lora.stacked import StackedLoraWeights
from gpu_runtime.model import CausalLM


class MultiLoraRuntime:
    """Adapters by name for one serving model (see the module docstring)."""

    def __init__(
        self,
        serving: CausalLM,
        *,
        max_tokens: int,
        num_slots: int = 8,
        max_rank: int = 64,
        target_modules: tuple[str, ...] = ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
        max_host_adapters: int = 32,
        share_gemms: bool = True,
    ) -> None:
        """``max_tokens``: most tokens in one engine step (its batched-token budget).
        ``share_gemms``: store the slots' A stacks as extra rows of ``serving``'s fused weights
        (one GEMM per projection group gives the base output and the LoRA shrink in decode
        steps; the base rows and their kernels are unchanged). Build the runtime before any
        finetune tree over ``serving``: it re-homes the projection weights."""
        weight = serving.lm_head.weight
        self.weights = StackedLoraWeights(
            serving.config,
            num_slots=num_slots,
            max_rank=max_rank,
            max_tokens=max_tokens,
            target_modules=target_modules,
            device=weight.device,
            dtype=weight.dtype,
            serving=serving if share_gemms else None,
            shard=serving.shard,
        )
        self.manager = AdapterManager(self.weights, max_host_adapters)
        self.forward = MultiLoraForward(serving, self.weights)
        self._attached: dict[str, str] = {}  # request id -> adapter name

    def register(self, name: str, directory: str | Path) -> None:
        self.manager.register(name, directory)

    def unregister(self, name: str) -> bool:
        """Stop serving ``name``: new requests for it are refused, attached ones finish with
        its slot (freed when the last detaches). False when it was not registered."""
        return self.manager.unregister(name)

    def names(self) -> list[str]:
        return self.manager.names()

    def has(self, name: str) -> bool:
        return self.manager.has(name)

    def can_admit(self, name: str) -> bool:
        """Whether :meth:`attach` would succeed now (resident, or a slot no request holds)."""
        if not self.has(name):
            raise UnknownAdapterError(name)
        return self.manager.slot_of(name) is not None or self.manager.has_free_slot()

    def attach(self, request_id: str, name: str) -> int:
        """Reference ``name``'s slot for ``request_id`` (loading it if needed); returns the slot."""
        if request_id in self._attached:
            raise ValueError(f"request {request_id!r} already uses {self._attached[request_id]!r}")
        slot = self.manager.acquire(name)
        self._attached[request_id] = name
        return slot

    def detach(self, request_id: str) -> None:
        """Drop ``request_id``'s reference; requests without an adapter are ignored."""
        name = self._attached.pop(request_id, None)
        if name is not None:
            self.manager.release(name)

    def slot_of_request(self, request_id: str) -> int:
        """The slot ``request_id`` uses while attached; -1 when it has no adapter."""
        name = self._attached.get(request_id)
        if name is None:
            return -1
        slot = self.manager.slot_of(name)
        assert slot is not None, f"{name!r} attached but not resident"
        return slot

    def decode_groups(self) -> list[dict[str, LoraGroup]]:
        """Per layer, the stacked slots of each projection group (for the engine's CUDA decode
        step; fixed tensors, rewritten in place when a slot changes)."""
        return self.weights.groups

    def set_batch(self, order: Sequence[tuple[str, int]]) -> bool:
        """Per-token slots for this step's tokens, ``order`` = ``(request_id, num_tokens)`` in
        the order the tokens are laid out. Returns whether any token uses an adapter."""
        if not any(request_id in self._attached for request_id, _ in order):
            return False  # base-only step: the serving model runs, the mask is not read
        slots: list[int] = []
        for request_id, count in order:
            name = self._attached.get(request_id)
            slot = -1 if name is None else self.manager.slot_of(name)
            assert slot is not None, f"{name!r} attached but not resident"
            slots.extend([slot] * count)
        self.weights.set_token_slots(torch.tensor(slots, dtype=torch.long))
        return any(s >= 0 for s in slots)
