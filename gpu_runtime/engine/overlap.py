"""Async scheduling: the next decode step is launched before this one's tokens are read back.

`OverlappedSteps` holds the step launched ahead between two `Engine.step` calls. A step is
launched ahead only when the scheduler is sure the next step decodes the same requests whatever
this one samples (`Scheduler.decode_follows`) and the runner can take it as a bucketed decode
step whose inputs it gathers on the device; this step's tokens are then counted as placeholders
(`UNRESOLVED_TOKEN`) while the next step is planned, and replaced once read back.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from gpu_runtime.engine.model_runner import ModelRunner
from gpu_runtime.engine.request import RequestOutput
from gpu_runtime.engine.runner_types import UNRESOLVED_TOKEN, StepHandle
from gpu_runtime.engine.scheduler import Scheduler, SchedulerOutput
from gpu_runtime.engine.step_outputs import StepOutputs
from gpu_runtime.engine.step_types import StepAhead, StepClock, ask_ahead, call_hook
from gpu_runtime.structured.outputs import StructuredOutputs


class OverlappedSteps:
    """The async-scheduling step over one scheduler and runner; see the module doc."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        outputs: StepOutputs,
        clock: StepClock,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """`structured`: the engine's grammar matchers. A step ahead that samples a constrained
        request is launched with its sampling deferred: its model runs while this step is read
        back and its tokens advance the matchers; then its masked sampling is queued."""
        self.scheduler = scheduler
        self.structured = structured
        self.runner = runner
        self.outputs = outputs
        self.clock = clock
        self.in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        """The step launched by the last call, read back by the next."""

    def step(
        self,
        partition: Hashable,
        on_launched: Callable[[], None] | None = None,
        ahead: StepAhead | None = None,
    ) -> list[RequestOutput]:
        """One step's outputs (`Engine.step`'s contract); the next decode step is launched
        before they are read back whenever `_can_overlap` allows it and `ahead` does not
        decline (then it is this call's successor's step)."""
        started = time.perf_counter()
        scheduler, runner = self.scheduler, self.runner
        outputs: list[RequestOutput] = []
        launch = sample = 0.0
        inflight, self.in_flight = self.in_flight, None
        if inflight is None:
            plan = scheduler.schedule()
            outputs += self.outputs.rejected()
            if plan.is_empty:
                if plan.finished_request_ids:
                    runner.execute(plan, partition)
                self.clock.record(started, time.perf_counter(), 0.0, 0.0, 0.0)
                return outputs
            handle = runner.launch(plan, partition)
            launch, sample = runner.last_launch_seconds, runner.last_sample_seconds
        else:
            plan, handle = inflight
        scheduled = time.perf_counter() - launch - sample
        hook_error = call_hook(on_launched)
        following: tuple[SchedulerOutput, StepHandle] | None = None
        overlapped = self._can_overlap(plan, handle)
        if overlapped:
            # count the step's tokens as known (placeholders) and plan the next step on them
            unresolved = dict.fromkeys(handle.sampled_ids, UNRESOLVED_TOKEN)
            scheduler.update_from_output(plan, unresolved)
            target: tuple[Hashable, Any] | None = (partition, None)
            if ahead is not None:
                target, error = ask_ahead(ahead.plan)
                hook_error = hook_error or error
            if target is not None:
                after = scheduler.schedule()
                outputs += self.outputs.rejected()
                if not after.is_empty:
                    structured = self.structured
                    defer = structured is not None and structured.any_constrained(
                        after.num_scheduled_tokens
                    )
                    following = (after, self._launch_ahead(after, *target, defer))
                    launch += runner.last_launch_seconds
                    sample += 0.0 if defer else runner.last_sample_seconds
                    if ahead is not None:
                        hook_error = hook_error or call_hook(ahead.launched)
        result = runner.resolve(handle)
        self.outputs.record_prompt_logprobs(result)  # before a fan-out parent forks
        if overlapped:
            scheduler.replace_last_tokens(result.sampled)
        else:
            scheduler.update_from_output(plan, result.sampled)
        self.outputs.sampled(result, outputs)
        if following is not None:
            if following[1].deferred is not None:  # the matchers hold this step's tokens now
                runner.sample_deferred(following[1])
                sample += runner.last_sample_seconds
            requests = scheduler.requests
            if any(rid in requests for rid in following[0].num_scheduled_tokens):
                self.in_flight = following
            else:  # everyone it computes for has finished
                runner.discard(following[1])
        if self.in_flight is None and not scheduler.has_unfinished_requests():
            idle = scheduler.schedule()  # as a synchronous step would: drop runner state now
            if idle.finished_request_ids:
                runner.execute(idle, partition)
        self.clock.record(started, scheduled, launch, sample, runner.last_wait_seconds)
        if hook_error is not None:
            raise hook_error
        return outputs

    def _launch_ahead(
        self, plan: SchedulerOutput, partition: Hashable, stream: Any, defer: bool = False
    ) -> StepHandle:
        """Launch the step ahead on `stream` (None: the current one), ordered after the
        current stream's work (the step it reads its input tokens from); `defer`: its sampling
        is queued later (`ModelRunner.sample_deferred`)."""
        runner = self.runner
        launch = functools.partial(runner.launch, defer_sampling=True) if defer else runner.launch
        if stream is None:
            return launch(plan, partition)
        current = torch.cuda.current_stream()
        if stream != current:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            return launch(plan, partition)

    def _can_overlap(self, plan: SchedulerOutput, handle: StepHandle) -> bool:
        """True when the step after `plan` can be launched before `plan` is read back: the
        runner takes it as a bucketed decode step gathering its inputs on the device, and the
        scheduler is sure it decodes the same requests whatever `plan` samples. Stop tokens
        and stop strings are not foreseen: such a request's next step is discarded."""
        runner = self.runner
        if handle.token_ids is None or not runner.static_decode:
            return False
        return self.scheduler.decode_follows(plan, runner.max_bucket)
