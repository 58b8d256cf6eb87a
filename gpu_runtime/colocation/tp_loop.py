"""The co-location loop over a tensor-parallel engine group: rank 0 plans, every rank applies.

Rank 0's `HostLoop` alone plans each iteration. Under tensor parallelism (the engine's model a
shard of a group of two or more, `HostLoop` checks) it mirrors what the followers must do
alike over the engine group's control channel, in the order it does it:

* the decode step's split: already in each `Launch` (`partition = decode_sms`); a follower
  with a sharing runs it on that split's decode stream (`engine.tp_follower`);
* each quantum handed to the executor: `MirroredExecutor` sends a `RunQuantum` order (job,
  max_tokens, mode, decode_sms, max_layers) before its inner executor starts it, for
  CONCURRENT (`submit`) and AFTER_DECODE (`run_now`) quanta alike, so every rank runs the same
  quanta in the same order (their collectives on the finetune communicator pair);
* jobs: `LoopMirror.added / removed / paused` send `AddJob` (with the job's `spec`, from
  which each follower's factory builds the same trainer over its shard), `RemoveJob` (after
  rank 0's own in-flight quantum of the job ended; each follower waits for its own) and
  `PauseJob` (bookkeeping: followers never plan).

The followers' side is `tp_follower_jobs.FollowerJobs`. A memory pool is refused at TP > 1
(KV grow/shrink and finetune lending are not mirrored yet). At TP 1 none of this exists and
the loop's iteration runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_runtime.colocation.executor import QuantumExecutor, QuantumTask
from gpu_runtime.colocation.types import LaunchMode, QuantumReport
from gpu_runtime.distributed.control import DriverChannel


@dataclass(frozen=True)
class RunQuantum:
    """Run one quantum of `job_id` on the job's trainer (FIFO, on the rank's worker)."""

    job_id: str
    max_tokens: int
    mode: LaunchMode
    decode_sms: int | None
    max_layers: int | None


@dataclass(frozen=True)
class AddJob:
    """Build job `job_id`'s trainer from `spec` (the follower's job factory) and keep it."""

    job_id: str
    spec: Any


@dataclass(frozen=True)
class RemoveJob:
    """Drop job `job_id` once its queued and in-flight quanta ended."""

    job_id: str


@dataclass(frozen=True)
class PauseJob:
    """Job `job_id` was paused (True) or resumed (False) on rank 0."""

    job_id: str
    paused: bool


JobMessage = RunQuantum | AddJob | RemoveJob | PauseJob


def order_of(task: QuantumTask) -> RunQuantum:
    return RunQuantum(task.job_id, task.max_tokens, task.mode, task.decode_sms, task.max_layers)


class MirroredExecutor(QuantumExecutor):
    """Rank 0's executor under TP: `inner`'s, each quantum's order sent first."""

    def __init__(self, inner: QuantumExecutor, control: DriverChannel) -> None:
        self.inner = inner
        self.control = control
        self.clock = inner.clock

    @property
    def in_flight(self) -> QuantumTask | None:
        return self.inner.in_flight

    @property
    def submitted_at(self) -> float | None:
        return self.inner.submitted_at

    @submitted_at.setter
    def submitted_at(self, value: float | None) -> None:
        self.inner.submitted_at = value

    def submit(self, task: QuantumTask) -> None:
        if self.inner.in_flight is not None:
            raise RuntimeError(f"quantum of {self.inner.in_flight.job_id!r} is still in flight")
        self.control.send(order_of(task))
        self.inner.submit(task)

    def run_now(self, task: QuantumTask) -> QuantumReport:
        self.control.send(order_of(task))
        return self.inner.run_now(task)

    def _start(self, task: QuantumTask) -> None:
        raise AssertionError("submit goes to the inner executor")

    def after_decode(self) -> None:
        self.inner.after_decode()

    def poll(self) -> list[QuantumReport]:
        return self.inner.poll()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.inner.wait(timeout_s)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # e.g. a persistent executor's `shutdown`
        return getattr(self.inner, name)


class LoopMirror:
    """Rank 0's job messages (see the module docstring)."""

    def __init__(self, control: DriverChannel) -> None:
        self.control = control

    def check_spec(self, job_id: str, spec: Any) -> None:
        """ValueError without a spec (before the job is added anywhere)."""
        if spec is None:
            raise ValueError(
                f"job {job_id!r}: under tensor parallelism add_job needs the job's spec (the "
                "followers' job factory builds their trainers from it)"
            )

    def added(self, job_id: str, spec: Any) -> None:
        self.check_spec(job_id, spec)
        self.control.send(AddJob(job_id, spec))

    def removed(self, job_id: str) -> None:
        self.control.send(RemoveJob(job_id))

    def paused(self, job_id: str, paused: bool) -> None:
        self.control.send(PauseJob(job_id, paused))


def mirror_loop(
    engine: Any, executor: QuantumExecutor, memory: Any
) -> tuple[QuantumExecutor, LoopMirror | None]:
    """The loop's executor and job mirror: `executor` and None at TP 1, else both mirrored
    over the engine group's channel (a memory pool refused)."""
    runner = engine.runner
    if runner.model.parallel.size < 2:
        return executor, None
    if memory is not None:
        raise NotImplementedError(
            "a memory pool under tensor parallelism: KV grow/shrink and finetune lending are "
            "not mirrored to the followers; run the TP co-location loop with memory=None"
        )
    control: DriverChannel = runner.control
    return MirroredExecutor(executor, control), LoopMirror(control)
