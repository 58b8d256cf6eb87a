"""The messages rank 0 of a tensor-parallel engine group sends its followers.

Each names one `ModelRunner` call and its arguments; a follower makes the same call on its
runner, in the order received (`tp_follower.Follower`). Steps are named by their launch number
(`StepHandle.step`), which is the same on every rank because every launch is mirrored. Only
calls that change runner or device state are sent; reads (timings, counters) are local.
Followers never schedule: every plan they run is one of these.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from gpu_runtime.contract.hparams import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class LoraSettings:
    """The `MultiLoraRuntime` every rank builds over its shard (its keyword arguments;
    `tp_lora.build_lora`); `max_tokens` None: the engine's `max_num_batched_tokens`."""

    max_tokens: int | None = None
    num_slots: int = 8
    max_rank: int = 64
    target_modules: tuple[str, ...] = field(default=ATTENTION_PROJECTIONS + MLP_PROJECTIONS)
    max_host_adapters: int = 32
    share_gemms: bool = True


@dataclass(frozen=True)
class Setup:
    """The first message: the engine config every follower builds its runner with (its own
    `device` put in), so KV block counts, buckets and paths agree; with `lora`, the adapter
    runtime every rank builds over its shard before its runner."""

    config: EngineConfig
    lora: LoraSettings | None = None


@dataclass(frozen=True)
class Launch:
    """`runner.launch(plan, partition, defer_sampling)`; `step` is its handle's number."""

    step: int
    plan: SchedulerOutput
    partition: Hashable = None
    defer_sampling: bool = False


@dataclass(frozen=True)
class SampleDeferred:
    """`runner.sample_deferred(handle of step)`."""

    step: int


@dataclass(frozen=True)
class Resolve:
    """`runner.resolve(handle of step)` (sent only for a handle not resolved at launch)."""

    step: int


@dataclass(frozen=True)
class Discard:
    """`runner.discard(handle of step)` (sent only for a handle not resolved)."""

    step: int


@dataclass(frozen=True)
class WaitForLaunched:
    """`runner.wait_for_launched()`."""


@dataclass(frozen=True)
class CaptureGraphs:
    """`runner.capture_cuda_graphs(batch_sizes, partition, sm_count=sm_count)` on every rank
    together (the captured steps hold the collectives)."""

    batch_sizes: tuple[int, ...] | None = None
    partition: Hashable = None
    sm_count: int | None = None


@dataclass(frozen=True)
class RegisterAdapter:
    """`lora.register(name, directory)` (sent once it succeeded on rank 0)."""

    name: str
    directory: str


@dataclass(frozen=True)
class UnregisterAdapter:
    """`lora.unregister(name)` (sent when rank 0's returned True)."""

    name: str


@dataclass(frozen=True)
class AttachAdapter:
    """`lora.attach(request_id, name)`; `slot` is rank 0's (a follower's must equal it)."""

    request_id: str
    name: str
    slot: int


@dataclass(frozen=True)
class DetachAdapter:
    """`lora.detach(request_id)` (sent only for an attached request)."""

    request_id: str


LoraMessage = RegisterAdapter | UnregisterAdapter | AttachAdapter | DetachAdapter
"""The messages a follower applies to its LoRA runtime (`tp_lora.apply_lora`)."""


@dataclass(frozen=True)
class Shutdown:
    """The last message: followers leave their loop and the group."""


RunnerMessage = (
    Launch | SampleDeferred | Resolve | Discard | WaitForLaunched | CaptureGraphs | LoraMessage
)
"""The messages a follower applies to its runner (and its LoRA runtime)."""
