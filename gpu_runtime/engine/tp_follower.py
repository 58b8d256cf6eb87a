"""A follower rank of a tensor-parallel engine group: its runner, driven by rank 0's messages.

`Follower` holds a plain `ModelRunner` over the rank's model shard, built with rank 0's
`EngineConfig` (so block counts, buckets and paths agree), with its own LoRA runtime when
rank 0 serves adapters (`tp_lora`: rank 0's adapter calls are replayed on it), and nothing
else: no scheduler, no stop rules, no tokenizer, no grammar matchers. `run()` applies each
message received (`tp_messages`) to the runner until `Shutdown`. Its sampler takes rank 0's tokens
(`tp_sampling.FollowerSampler`), so its request states hold the same tokens as rank 0's.

The invariant: a follower never decides anything. It makes rank 0's runner calls in rank 0's
order with rank 0's arguments, so its collectives pair with rank 0's one for one; a launch
whose step number differs from rank 0's, or a message naming a step it does not hold, means
the two diverged and raises `EngineGroupError` (the rank exits; rank 0 sees it die).
"""

from __future__ import annotations

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


class Follower:
    """Rank `model.parallel.rank` (> 0) of an engine group; see the module docstring."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        channel: FollowerChannel,
        lora: MultiLoraRuntime | None = None,
    ) -> None:
        """`lora`: the rank's runtime over `model` (`tp_lora.follower_lora`) when rank 0 serves
        adapters."""
        if model.parallel.is_driver:
            raise ValueError("rank 0 drives the engine group; followers are ranks 1..N-1")
        self.lora = lora
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
                return
            self.apply(message)

    def apply(self, message: RunnerMessage) -> None:
        """Make the runner call `message` names."""
        runner = self.runner
        if isinstance(message, Launch):
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
                message.batch_sizes, message.partition, sm_count=message.sm_count
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
