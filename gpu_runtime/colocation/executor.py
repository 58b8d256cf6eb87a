"""Where finetune quanta run: inline after the decode step (CPU) or on a worker thread (GPU).

A concurrent quantum on a GPU must overlap the decode step, but ``LoraTrainer.step_quantum`` ends
with a host sync; so a single worker thread runs quanta on the finetune stream while the loop's
thread runs decode on its own stream. PyTorch releases the GIL inside kernel launches, the
autograd engine and synchronisation, so the two threads interleave; the loop shortens Python's
switch interval while a quantum is in flight so that decode's host work is not held back by up
to 5 ms per GIL hand-over. On CPU there is nothing to overlap with, so quanta run inline right
after the decode step (sequentially), which keeps tests deterministic.
"""

from __future__ import annotations

import queue
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from gpu_runtime.colocation.types import LaunchMode, QuantumReport
from gpu_runtime.finetune.trainer import LoraTrainer


@dataclass(frozen=True)
class QuantumTask:
    """One quantum to run: which trainer, how big, on which stream."""

    job_id: str
    trainer: LoraTrainer
    max_tokens: int
    mode: LaunchMode
    decode_sms: int | None
    stream: Any = None
    """A ``torch.cuda.Stream`` to make current while the quantum runs (None: leave as is)."""
    max_layers: int | None = None
    """Layer-sliced quantum (see ``FinetuneLaunch.max_layers``)."""


def run_quantum(task: QuantumTask, clock: Callable[[], float]) -> QuantumReport:
    """Run ``task`` to its end (the trainer's own host sync); errors become a failed report."""
    context: AbstractContextManager[Any] = nullcontext()
    if task.stream is not None:
        import torch

        context = torch.cuda.stream(task.stream)
    device = task.trainer.device
    cuda = device.type == "cuda"
    if cuda:
        import torch

        allocated_before = torch.cuda.memory_allocated(device)
    start = clock()
    try:
        with context:
            if task.max_layers is None:
                result = task.trainer.step_quantum(max_tokens=task.max_tokens)
            else:
                result = task.trainer.step_quantum(
                    max_tokens=task.max_tokens, max_layers=task.max_layers
                )
    except Exception as exc:  # reported to the loop, which fails the job; decode goes on
        return QuantumReport(
            job_id=task.job_id,
            tokens=0,
            duration_ms=(clock() - start) * 1e3,
            mode=task.mode,
            decode_sms=task.decode_sms,
            error=f"{type(exc).__name__}: {exc}",
        )
    checkpoint = result.checkpoint
    peak = result.peak_memory_bytes
    extra = max(peak - allocated_before, 0) if cuda and peak is not None else None
    return QuantumReport(
        job_id=task.job_id,
        tokens=int(result.tokens),
        duration_ms=(clock() - start) * 1e3,
        mode=task.mode,
        decode_sms=task.decode_sms,
        loss=None if result.loss is None else float(result.loss),
        step=int(result.step),
        optimizer_step=bool(result.optimizer_step),
        job_finished=bool(result.finished),
        peak_memory_bytes=peak,
        layer_passes=int(getattr(result, "layer_passes", 0)),
        micro_batch_done=bool(getattr(result, "micro_batch_done", True)),
        finetune_peak_bytes=extra,
        checkpoint=None if checkpoint is None else str(checkpoint),
    )


class QuantumExecutor(ABC):
    """Runs CONCURRENT quanta (one at a time); AFTER_DECODE quanta run inline via ``run_now``.

    ``in_flight`` stays set from ``submit`` until ``poll`` has returned that quantum's report,
    so the loop's view of what is running only changes at its own polling points.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._in_flight: QuantumTask | None = None
        self.submitted_at: float | None = None

    @property
    def in_flight(self) -> QuantumTask | None:
        return self._in_flight

    def submit(self, task: QuantumTask) -> None:
        """Start a concurrent quantum; RuntimeError when one is still in flight."""
        if self._in_flight is not None:
            raise RuntimeError(f"quantum of {self._in_flight.job_id!r} is still in flight")
        self._in_flight = task
        self.submitted_at = self.clock()
        self._start(task)

    def run_now(self, task: QuantumTask) -> QuantumReport:
        """Run a quantum on the calling thread and wait for it."""
        return run_quantum(task, self.clock)

    @abstractmethod
    def _start(self, task: QuantumTask) -> None: ...

    @abstractmethod
    def after_decode(self) -> None:
        """Called by the loop right after the decode step returned."""

    @abstractmethod
    def poll(self) -> list[QuantumReport]:
        """Reports of quanta finished since the last poll (never blocks)."""

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the in-flight quantum has finished (True) or the timeout passed."""

    @abstractmethod
    def close(self) -> None:
        """Wait for the in-flight quantum and stop (idempotent)."""


class SequentialExecutor(QuantumExecutor):
    """CPU: a concurrent quantum runs inline right after the decode step it was launched with."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self._pending: QuantumTask | None = None
        self._done: list[QuantumReport] = []

    def _start(self, task: QuantumTask) -> None:
        self._pending = task

    def after_decode(self) -> None:
        self._run_pending()

    def _run_pending(self) -> None:
        task, self._pending = self._pending, None
        if task is not None:
            self._done.append(run_quantum(task, self.clock))

    def poll(self) -> list[QuantumReport]:
        done, self._done = self._done, []
        if done:
            self._in_flight = None
        return done

    def wait(self, timeout_s: float | None = None) -> bool:
        self._run_pending()
        return True

    def close(self) -> None:
        self._run_pending()


class ThreadedExecutor(QuantumExecutor):
    """GPU: one worker thread runs each concurrent quantum on its finetune stream."""

    SWITCH_INTERVAL_S = 0.0002
    """Python's GIL switch interval while a quantum is in flight (default 0.005)."""

    def __init__(self, clock: Callable[[], float], *, persistent: bool = False) -> None:
        """``persistent``: ``close()`` only waits for the in-flight quantum and the worker
        thread lives on for the next loop (``shutdown()`` stops it); CUDA-graphed quanta warm
        up once per (thread, stream), so loops run one after another share one thread."""
        super().__init__(clock)
        self.persistent = persistent
        self._tasks: queue.Queue[QuantumTask | None] = queue.Queue()
        self._done: queue.Queue[QuantumReport] = queue.Queue()
        self._finished = threading.Event()
        self._finished.set()
        self._saved_interval = sys.getswitchinterval()
        self._thread = threading.Thread(target=self._work, name="finetune-quanta", daemon=True)
        self._thread.start()
        self._closed = False

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            self._done.put(run_quantum(task, self.clock))
            self._finished.set()

    def _start(self, task: QuantumTask) -> None:
        if self._closed:
            raise RuntimeError("executor is closed")
        self._finished.clear()
        sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self._tasks.put(task)

    def after_decode(self) -> None:
        return None

    def poll(self) -> list[QuantumReport]:
        done: list[QuantumReport] = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        if done:
            self._in_flight = None
            sys.setswitchinterval(self._saved_interval)
        return done

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._finished.wait(timeout_s)

    def close(self) -> None:
        if self.persistent:
            self._finished.wait()
            sys.setswitchinterval(self._saved_interval)
            return
        self.shutdown()

    def shutdown(self) -> None:
        """Wait for the in-flight quantum and stop the worker thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finished.wait()
        self._tasks.put(None)
        self._thread.join()
        sys.setswitchinterval(self._saved_interval)
