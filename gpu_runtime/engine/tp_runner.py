"""Rank 0's model runner in a tensor-parallel engine group: every call that changes runner or
device state is first sent to the followers (`tp_messages`), then run locally.

`MirroredRunner` is a `ModelRunner` whose `launch`, `sample_deferred`, `resolve`, `discard`,
`wait_for_launched` and `capture_cuda_graphs` send their message over the group's
`DriverChannel` before running; `execute` is `resolve(launch(...))`, so it is mirrored as
those two. Everything the engine, the async-scheduling overlap, the co-location loop or the
memory pool calls on `engine.runner` goes through these methods, so the followers' runners
make the same calls in the same order and issue the same collectives. Reads (timings,
counters, `static_decode`, `max_bucket`) stay local. The engine builds it when its model is a
shard of a group of two or more (`Engine(..., control=channel)`); at size 1 the engine holds a
plain `ModelRunner` and none of this exists.

With adapters, the runner's `lora` is rank 0's `tp_lora.MirroredLoraRuntime` (its own calls
mirrored); `set_batch` runs inside each rank's launch. A capture on a caller's stream is
mirrored only for a partition: rank 0 captures on the stream it passed (its split's decode
stream), each follower on its own split's (`Follower.decode_stream`).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gpu_runtime.distributed.control import DriverChannel
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.kv_cache import KVStorageFactory, default_kv_storage
from gpu_runtime.engine.model_runner import ModelRunner
from gpu_runtime.engine.runner_types import ModelRunnerOutput, StepHandle
from gpu_runtime.engine.scheduler import SchedulerOutput
from gpu_runtime.engine.tp_lora import MirroredLoraRuntime
from gpu_runtime.engine.tp_messages import (
    CaptureGraphs,
    Discard,
    Launch,
    Resolve,
    SampleDeferred,
    WaitForLaunched,
)
from gpu_runtime.lora.protocol import LoraRuntime
from gpu_runtime.model.llama import CausalLM
from gpu_runtime.structured.outputs import StructuredOutputs


class MirroredRunner(ModelRunner):
    """The driver's runner (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        control: DriverChannel,
        kv_storage_factory: KVStorageFactory = default_kv_storage,
        lora: LoraRuntime | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        if not model.parallel.is_driver or model.parallel.size < 2:
            raise ValueError(f"a mirrored runner runs rank 0 of a group, got {model.parallel}")
        _check_mirrored_lora(lora)
        super().__init__(model, config, kv_storage_factory, lora=lora, structured=structured)
        self.control = control

    def launch(
        self, output: SchedulerOutput, partition: Hashable = None, defer_sampling: bool = False
    ) -> StepHandle:
        self.control.send(Launch(self._num_launched, output, partition, defer_sampling))
        return super().launch(output, partition, defer_sampling)

    def sample_deferred(self, handle: StepHandle) -> None:
        if handle.deferred is not None:
            self.control.send(SampleDeferred(handle.step))
        super().sample_deferred(handle)

    def resolve(self, handle: StepHandle) -> ModelRunnerOutput:
        if not handle.resolved:
            self.control.send(Resolve(handle.step))
        return super().resolve(handle)

    def discard(self, handle: StepHandle) -> None:
        if not handle.resolved:
            self.control.send(Discard(handle.step))
        super().discard(handle)

    def wait_for_launched(self) -> None:
        self.control.send(WaitForLaunched())
        super().wait_for_launched()

    def capture_cuda_graphs(
        self,
        batch_sizes: tuple[int, ...] | None = None,
        partition: Hashable = None,
        stream: torch.cuda.Stream | None = None,
        sm_count: int | None = None,
    ) -> list[int]:
        if stream is not None and partition is None:
            raise NotImplementedError(
                "a tensor-parallel engine captures on a stream only for a partition (each "
                "follower captures on its own split's decode stream)"
            )
        sizes = tuple(batch_sizes) if batch_sizes is not None else None
        self.control.send(CaptureGraphs(sizes, partition, sm_count))
        return super().capture_cuda_graphs(sizes, partition, stream, sm_count)


def check_engine_parallel(
    model: CausalLM, control: DriverChannel | None, lora: LoraRuntime | None
) -> None:
    """An `Engine` runs rank 0 only, with a control channel exactly when its model is a shard
    of a group of two or more, and then only with a mirrored LoRA runtime (or none)."""
    parallel = model.parallel
    if (parallel.size > 1) != (control is not None):
        raise ValueError(
            f"a control channel goes with a tensor-parallel model and only then: size "
            f"{parallel.size}, control {control!r} (start TP engines with start_engine_group)"
        )
    if not parallel.is_driver:
        raise ValueError(f"rank {parallel.rank} is a follower: only rank 0 runs an Engine")
    if control is not None:
        _check_mirrored_lora(lora)


def _check_mirrored_lora(lora: LoraRuntime | None) -> None:
    if lora is not None and not isinstance(lora, MirroredLoraRuntime):
        raise TypeError(
            f"a tensor-parallel engine serves adapters through a MirroredLoraRuntime (start it "
            f"with start_engine_group(..., lora=LoraSettings(...))), got {type(lora).__name__}"
        )


def runner_for(
    model: CausalLM,
    config: EngineConfig,
    kv_storage_factory: KVStorageFactory,
    lora: LoraRuntime | None,
    structured: StructuredOutputs | None,
    control: DriverChannel | None,
) -> ModelRunner:
    """The engine's runner: a plain `ModelRunner` without `control` (TP size 1), else a
    `MirroredRunner` over it."""
    if control is None:
        return ModelRunner(model, config, kv_storage_factory, lora=lora, structured=structured)
    return MirroredRunner(model, config, control, kv_storage_factory, lora, structured)
