"""A follower rank's finetune jobs under a tensor-parallel co-location loop (`tp_loop`).

`FollowerJobs` is the `FollowerPart` of an engine group's follower (`engine.tp_follower`):
it takes rank 0's job messages and leaves the runner's to the runner. Rules:

* Trainers. `AddJob(job_id, spec)` builds the job's trainer with the job factory given at
  start, `job_factory(job_id, spec, serving)` over the rank's serving shard (tests pass one
  building the same tiny trainer as rank 0; the host agent one building from the placement),
  so every rank trains the same job's slice.
* Quanta. `RunQuantum` queues the quantum for one worker thread that runs them FIFO
  (`executor.run_quantum`), on the split's finetune stream with a sharing (`partition(
  decode_sms)[1]`), else the current one. The main thread goes back to the channel at once:
  decode (main thread, decode communicator) and finetune (worker, finetune communicator) run
  rank 0's work in rank 0's order each, so neither waits on the other.
* Removal. `RemoveJob` waits until the worker ran the job's queued and in-flight quanta (only
  the job's: a decode step is not held behind another job's quantum), then drops the
  trainer. Rank 0 sends it after its own quantum of the job ended, and runs one quantum at a
  time, so the job's last quantum and every one queued before it here have ended on rank 0:
  the wait cannot deadlock. `PauseJob` is bookkeeping (`paused`).
* Failure. A quantum that raises is reported like rank 0's (`reports`, error set) and the
  worker goes on; an order for a job this rank does not hold means the ranks diverged
  (`EngineGroupError`). `close()` (at `Shutdown`) waits for the queue and stops the worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_runtime.colocation.executor import QuantumTask, run_quantum
from gpu_runtime.colocation.tp_loop import AddJob, PauseJob, RemoveJob, RunQuantum
from gpu_runtime.colocation.types import QuantumReport
from gpu_runtime.distributed.control import EngineGroupError
from gpu_runtime.engine.tp_follower import Follower
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model.llama import CausalLM

logger = logging.getLogger(__name__)

JobFactory = Callable[[str, Any, CausalLM], LoraTrainer]
"""`(job_id, spec, serving shard) -> trainer`: the hook that builds a follower's trainer."""


class FollowerJobs:
    """One follower's jobs (see the module docstring)."""

    def __init__(
        self,
        serving: CausalLM,
        job_factory: JobFactory,
        sharing: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.serving = serving
        self.job_factory = job_factory
        self.sharing = sharing
        self.clock = clock
        self.trainers: dict[str, LoraTrainer] = {}
        self.paused: set[str] = set()
        self.reports: list[QuantumReport] = []
        """Every quantum this rank ran, in order."""
        self._tasks: queue.Queue[QuantumTask | None] = queue.Queue()
        self._queued: dict[str, int] = {}  # job id -> its quanta queued or running
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="follower-quanta", daemon=True)
        self._thread.start()
        self._closed = False

    def apply(self, message: Any) -> bool:
        if isinstance(message, RunQuantum):
            task = self._task(message)
            with self._done:
                self._queued[task.job_id] = self._queued.get(task.job_id, 0) + 1
            self._tasks.put(task)
        elif isinstance(message, AddJob):
            if message.job_id in self.trainers:
                raise EngineGroupError(f"job {message.job_id!r} added twice: the ranks diverged")
            self.trainers[message.job_id] = self.job_factory(
                message.job_id, message.spec, self.serving
            )
        elif isinstance(message, RemoveJob):
            self._trainer(message.job_id)
            with self._done:  # the job's quanta only: decode goes on beside another job's
                self._done.wait_for(lambda: not self._queued.get(message.job_id))
            del self.trainers[message.job_id]
            self.paused.discard(message.job_id)
        elif isinstance(message, PauseJob):
            self._trainer(message.job_id)
            if message.paused:
                self.paused.add(message.job_id)
            else:
                self.paused.discard(message.job_id)
        else:
            return False
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tasks.put(None)
        self._thread.join()

    def _trainer(self, job_id: str) -> LoraTrainer:
        trainer = self.trainers.get(job_id)
        if trainer is None:
            rank = self.serving.parallel.rank
            raise EngineGroupError(f"rank {rank} holds no job {job_id!r}: the ranks diverged")
        return trainer

    def _task(self, order: RunQuantum) -> QuantumTask:
        stream = None
        if self.sharing is not None and order.decode_sms is not None:
            stream = self.sharing.partition(order.decode_sms)[1]
        return QuantumTask(
            order.job_id,
            self._trainer(order.job_id),
            order.max_tokens,
            order.mode,
            order.decode_sms,
            stream,
            order.max_layers,
        )

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                self._tasks.task_done()
                return
            try:
                report = run_quantum(task, self.clock)
                if report.error is not None:
                    logger.error("quantum of %s failed: %s", task.job_id, report.error)
                self.reports.append(report)
            finally:
                with self._done:
                    self._queued[task.job_id] -= 1
                    self._done.notify_all()
                self._tasks.task_done()


@dataclass(frozen=True)
class FollowerJobsFactory:
    """The engine group's `follower_part`: each follower's `FollowerJobs` with `job_factory`
    (picklable: a module-level function)."""

    job_factory: JobFactory

    def __call__(self, follower: Follower) -> FollowerJobs:
        return FollowerJobs(follower.runner.model, self.job_factory, follower.sharing)
