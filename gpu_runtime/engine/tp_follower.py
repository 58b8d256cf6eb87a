"""A follower rank of a tensor-parallel engine group: its runner, driven by rank 0's messages.

`Follower` holds a plain `ModelRunner` over the rank's model shard, built with rank 0's
`EngineConfig` (so block counts, buckets and paths agree), with its own LoRA runtime when
rank 0 serves adapters (`tp_lora`: rank 0's adapter calls are replayed on it), and nothing
else: no scheduler, no stop rules, no tokenizer, no grammar matchers. `run()` applies each
message received (`tp_messages`) to the runner until `Shutdown`. Its sampler takes rank 0's tokens
(`tp_sampling.FollowerSampler`), so its request states hold the same tokens as rank 0's.

On a GPU with a `sharing` (`gpu_runtime.sharing.GpuSharing`, the same split table as rank
0's), a launch or capture naming a partition (an SM split `decode_sms`) runs on that split's
decode stream (`sharing.partition(decode_sms)[0]`), as rank 0's loop runs it. A `part`
(`FollowerPart`, e.g. the co-location loop's `colocation.tp_follower_jobs.FollowerJobs`)
sees every message first and takes the ones it handles; it is closed at `Shutdown`.

The invariant: a follower never decides anything. It makes rank 0's runner calls in rank 0's
order with rank 0's arguments, so its collectives pair with rank 0's one for one; a launch
whose step number differs from rank 0's, or a message naming a step it does not hold, means
the two diverged and raises `EngineGroupError` (the rank exits; rank 0 sees it die).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from gpu_runtime.distributed.control import EngineGroupError, FollowerChannel
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.model_runner import ModelRunner
from gpu_runtime.engine.runner_types import StepHandle
from gpu_runtime.engine.tp_lora import apply_lora
from gpu_runtime.engine.tp_messages import (
    AttachAdapter,
    CaptureGraphs,
    DetachAdapter,
    Discard,
    Launch,
    RegisterAdapter,
    Resolve,
    RunnerMessage,
    SampleDeferred,
    Shutdown,
    UnregisterAdapter,
    WaitForLaunched,
)
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model.llama import CausalLM

_LORA_MESSAGES = (RegisterAdapter, UnregisterAdapter, AttachAdapter, DetachAdapter)


class FollowerPart(Protocol):
    """What a follower runs beside its runner, driven by rank 0's messages too."""

    def apply(self, message: Any) -> bool:
        """Apply `message` when it is this part's (True), else leave it (False)."""
        ...

    def close(self) -> None:
        """The group shuts down: finish and stop (waits for work in flight)."""
        ...


FollowerPartFactory = Callable[["Follower"], FollowerPart]
"""Builds a follower's part once its runner exists (picklable: it crosses the spawn)."""


class Follower:
    """Rank `model.parallel.rank` (> 0) of an engine group; see the module docstring."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        channel: FollowerChannel,
        lora: MultiLoraRuntime | None = None,
        sharing: Any = None,
    ) -> None:
        """`lora`: the rank's runtime over `model` (`tp_lora.follower_lora`) when rank 0 serves
        adapters; `sharing`: the rank's GPU sharing (None: the current stream)."""
        if model.parallel.is_driver:
            raise ValueError("rank 0 drives the engine group; followers are ranks 1..N-1")
        self.lora = lora
        self.sharing = sharing
        self.part: FollowerPart | None = None
        """Set by the group's part factory, if any."""
        self._last_stream: Any = None
        self.runner = ModelRunner(model, config, lora=lora)
        self.channel = channel
        self.num_applied = 0
        """Messages applied so far."""
        self._handles: dict[int, StepHandle] = {}

    def run(self) -> None:
        """Apply messages until `Shutdown`."""
        while True:
            message = self.channel.receive()
            if isinstance(message, Shutdown):
                if self.part is not None:
                    self.part.close()
                return
            if self.part is not None and self.part.apply(message):
                self.num_applied += 1
                continue
            self.apply(message)

    def decode_stream(self, partition: Hashable) -> Any:
        """The stream of `partition`'s decode work: its split's decode stream with a sharing,
        else None (the current stream)."""
        if self.sharing is None or partition is None:
            return None
        return self.sharing.partition(partition)[0]

    def _on(self, partition: Hashable) -> AbstractContextManager[Any]:
        """Where a launch for `partition` runs: with a sharing, its split's decode stream (the
        current one for None), ordered after the stream the previous launch ran on (a step
        launched ahead reads the previous step's tokens and KV)."""
        if self.sharing is None:
            return nullcontext()
        stream = self.decode_stream(partition) or torch.cuda.current_stream()
        last = self._last_stream
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._last_stream = stream
        return torch.cuda.stream(stream)

    def apply(self, message: RunnerMessage) -> None:
        """Make the runner call `message` names."""
        runner = self.runner
        if isinstance(message, Launch):
            with self._on(message.partition):
                handle = runner.launch(message.plan, message.partition, message.defer_sampling)
            if handle.step != message.step:
                raise EngineGroupError(
                    f"rank {runner.model.parallel.rank} launched step {handle.step} for rank "
                    f"0's step {message.step}: the runners diverged"
                )
            if not handle.resolved:
                self._handles[handle.step] = handle
        elif isinstance(message, SampleDeferred):
            runner.sample_deferred(self._handle(message.step))
        elif isinstance(message, Resolve):
            runner.resolve(self._handle(message.step, pop=True))
        elif isinstance(message, Discard):
            runner.discard(self._handle(message.step, pop=True))
        elif isinstance(message, WaitForLaunched):
            runner.wait_for_launched()
        elif isinstance(message, _LORA_MESSAGES):
            apply_lora(self.lora, message, runner.model.parallel.rank)
        elif isinstance(message, CaptureGraphs):
            runner.capture_cuda_graphs(
                message.batch_sizes,
                message.partition,
                self.decode_stream(message.partition),
                sm_count=message.sm_count,
            )
        else:
            raise EngineGroupError(f"unknown engine-group message {message!r}")
        self.num_applied += 1

    def _handle(self, step: int, pop: bool = False) -> StepHandle:
        handle = self._handles.pop(step, None) if pop else self._handles.get(step)
        if handle is None:
            raise EngineGroupError(
                f"rank {self.runner.model.parallel.rank} holds no unresolved step {step}: "
                "the runners diverged"
            )
        return handle
