"""LoRA adapters in a tensor-parallel engine group: rank 0's adapter calls, mirrored.

Every rank holds one `MultiLoraRuntime` over its model shard, built from the same
`LoraSettings` (`tp_messages`, sent in `Setup`; `follower_lora` builds a follower's), so its
slots hold each adapter's slice of the same layout.
Rank 0's is a `MirroredLoraRuntime`: `register`, `unregister`, `attach` and `detach` run
locally first and, when they changed something, send their message (`tp_messages`) to the
followers, which make the same call on their runtime (`apply_lora`). A follower reads the
adapter from the same directory and keeps its slice (`HostAdapter` cuts with `shard.take`).

The rules:
* Order. A lock covers each call and its send, so the followers apply them in rank 0's order
  whatever thread registers (the server's, the engine's); an attach is sent before the launch
  that reads its slot, a detach before the next launch, because the engine's thread sends both.
* Failure first on rank 0. A call that raises on rank 0 (an unknown or refused adapter, no
  free slot) sends nothing, so a follower only ever replays calls that succeeded; one that
  then fails on a follower means the ranks diverged (`EngineGroupError`, the rank exits).
* Steps. `set_batch` is not sent: each follower's runner calls it in its own replay of the
  launch, from the same request states and the same attachments.
"""

from __future__ import annotations

import threading
from pathlib import Path

from gpu_runtime.distributed.control import DriverChannel, EngineGroupError
from gpu_runtime.engine.tp_messages import (
    AttachAdapter,
    DetachAdapter,
    LoraMessage,
    LoraSettings,
    RegisterAdapter,
    UnregisterAdapter,
)
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model.llama import CausalLM


class MirroredLoraRuntime(MultiLoraRuntime):
    """Rank 0's runtime (see the module docstring)."""

    def __init__(
        self,
        serving: CausalLM,
        settings: LoraSettings,
        max_num_batched_tokens: int,
        control: DriverChannel,
    ) -> None:
        if not serving.parallel.is_driver or serving.parallel.size < 2:
            raise ValueError(f"a mirrored LoRA runtime runs rank 0 of a group, got {serving}")
        super().__init__(
            serving,
            max_tokens=settings.max_tokens or max_num_batched_tokens,
            num_slots=settings.num_slots,
            max_rank=settings.max_rank,
            target_modules=settings.target_modules,
            max_host_adapters=settings.max_host_adapters,
            share_gemms=settings.share_gemms,
        )
        self.control = control
        self._lock = threading.Lock()

    def register(self, name: str, directory: str | Path) -> None:
        with self._lock:
            super().register(name, directory)
            self.control.send(RegisterAdapter(name, str(directory)))

    def unregister(self, name: str) -> bool:
        with self._lock:
            served = super().unregister(name)
            if served:
                self.control.send(UnregisterAdapter(name))
            return served

    def attach(self, request_id: str, name: str) -> int:
        with self._lock:
            slot = super().attach(request_id, name)
            self.control.send(AttachAdapter(request_id, name, slot))
            return slot

    def detach(self, request_id: str) -> None:
        with self._lock:
            attached = request_id in self._attached
            super().detach(request_id)
            if attached:
                self.control.send(DetachAdapter(request_id))


def follower_lora(
    serving: CausalLM, settings: LoraSettings, max_num_batched_tokens: int
) -> MultiLoraRuntime:
    """A follower's runtime over its shard, as rank 0's is built."""
    return MultiLoraRuntime(
        serving,
        max_tokens=settings.max_tokens or max_num_batched_tokens,
        num_slots=settings.num_slots,
        max_rank=settings.max_rank,
        target_modules=settings.target_modules,
        max_host_adapters=settings.max_host_adapters,
        share_gemms=settings.share_gemms,
    )


def apply_lora(runtime: MultiLoraRuntime | None, message: LoraMessage, rank: int) -> None:
    """A follower's replay of one of rank 0's adapter calls on its `runtime`."""
    if runtime is None:
        raise EngineGroupError(f"rank {rank} has no LoRA runtime for {message!r}")
    try:
        if isinstance(message, RegisterAdapter):
            runtime.register(message.name, message.directory)
        elif isinstance(message, UnregisterAdapter):
            if not runtime.unregister(message.name):
                raise EngineGroupError(f"{message.name!r} was not registered")
        elif isinstance(message, AttachAdapter):
            slot = runtime.attach(message.request_id, message.name)
            if slot != message.slot:
                raise EngineGroupError(f"slot {slot}, rank 0's is {message.slot}")
        else:
            runtime.detach(message.request_id)
    except Exception as exc:
        raise EngineGroupError(
            f"rank {rank} could not replay {message!r}: the ranks diverged ({exc})"
        ) from exc
