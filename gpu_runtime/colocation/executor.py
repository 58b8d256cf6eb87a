"""Where finetune quanta run: inline after the decode step (CPU), or beside it on the GPU.

A concurrent quantum on a GPU must overlap the decode step. A job whose micro-batches replay
CUDA graphs costs the host a few launches per quantum, so the loop's own thread launches it on
the finetune stream (``LoraTrainer.start_quantum``) and goes back to decode; ``poll`` asks the
quantum's CUDA event whether it is done and only then reads its result, so no thread waits on the
GPU and no Python work competes with decode's for the GIL. Anything else (eager or layer-sliced
quanta: thousands of host-side launches, tens of ms of Python ending in a host sync) runs on one
worker thread on the finetune stream while the loop's thread decodes on its own; PyTorch releases
the GIL inside kernel launches, the autograd engine and synchronisation, so the two threads
interleave, and the loop shortens Python's switch interval while such a quantum is in flight so
that decode's host work is not held back by up to 5 ms per GIL hand-over. On CPU there is nothing
to overlap with, so quanta run inline right after the decode step (sequentially), which keeps
tests deterministic.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from gpu_runtime.colocation.snapshot import trainer_replays_graphs
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


def _stream_context(task: QuantumTask) -> AbstractContextManager[Any]:
    if task.stream is None:
        return nullcontext()
    import torch

    return torch.cuda.stream(task.stream)


def _allocated(task: QuantumTask) -> int | None:
    device = task.trainer.device
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.memory_allocated(device))


def _failed(task: QuantumTask, duration_ms: float, exc: Exception) -> QuantumReport:
    return QuantumReport(
        job_id=task.job_id,
        tokens=0,
        duration_ms=duration_ms,
        mode=task.mode,
        decode_sms=task.decode_sms,
        error=f"{type(exc).__name__}: {exc}",
    )


def run_quantum(task: QuantumTask, clock: Callable[[], float]) -> QuantumReport:
    """Run ``task`` to its end (the trainer's own host sync); errors become a failed report."""
    allocated_before = _allocated(task)
    start = clock()
    try:
        with _stream_context(task):
            if task.max_layers is None:
                result = task.trainer.step_quantum(max_tokens=task.max_tokens)
            else:
                result = task.trainer.step_quantum(
                    max_tokens=task.max_tokens, max_layers=task.max_layers
                )
    except Exception as exc:  # reported to the loop, which fails the job; decode goes on
        return _failed(task, (clock() - start) * 1e3, exc)
    return quantum_report(task, result, (clock() - start) * 1e3, allocated_before)


def quantum_report(
    task: QuantumTask, result: Any, duration_ms: float, allocated_before: int | None
) -> QuantumReport:
    """The loop's report of ``task`` from its ``QuantumResult``."""
    checkpoint = result.checkpoint
    peak = result.peak_memory_bytes
    extra = None
    if allocated_before is not None and peak is not None:
        extra = max(peak - allocated_before, 0)
    return QuantumReport(
        job_id=task.job_id,
        tokens=int(result.tokens),
        duration_ms=duration_ms,
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
        graph=getattr(result, "graph", None),
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


def launches_without_waiting(task: QuantumTask) -> bool:
    """Whether ``task`` is a whole micro-batch of a trainer whose micro-batches replay CUDA
    graphs (``LoraTrainer.start_quantum`` then only issues launches)."""
    return (
        task.max_layers is None
        and trainer_replays_graphs(task.trainer)
        and hasattr(task.trainer, "start_quantum")
    )


@dataclass
class _Launched:
    task: QuantumTask
    pending: Any  # gpu_runtime.finetune.pending.PendingQuantum
    started: float
    allocated_before: int | None


class ThreadedExecutor(QuantumExecutor):
    """GPU: graphed quanta launched from the loop's thread, the rest on one worker thread, each
    on its finetune stream (see the module docstring)."""

    SWITCH_INTERVAL_S = 0.0002
    """Python's GIL switch interval while a worker-thread quantum is in flight (default 0.005)."""
    WAIT_POLL_S = 0.0002
    """Sleep between CUDA event queries while ``wait`` waits for a launched quantum."""

    def __init__(
        self, clock: Callable[[], float], *, persistent: bool = False, launch_inline: bool = True
    ) -> None:
        """``persistent``: ``close()`` only waits for the in-flight quantum and the worker
        thread lives on for the next loop (``shutdown()`` stops it); CUDA-graphed quanta warm
        up once per (thread, stream), so loops run one after another share one thread.
        ``launch_inline``: launch graphed quanta from the calling thread (False: every quantum
        goes to the worker thread)."""
        super().__init__(clock)
        self.persistent = persistent
        self.launch_inline = launch_inline
        self._launched: _Launched | None = None
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
        if self.launch_inline and launches_without_waiting(task):
            self._launch(task)
            return
        self._finished.clear()
        sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self._tasks.put(task)

    def _launch(self, task: QuantumTask) -> None:
        allocated_before = _allocated(task)
        started = self.clock()
        try:
            with _stream_context(task):
                pending = task.trainer.start_quantum(max_tokens=task.max_tokens)
        except Exception as exc:  # reported at the next poll; decode goes on
            self._done.put(_failed(task, (self.clock() - started) * 1e3, exc))
            return
        self._launched = _Launched(task, pending, started, allocated_before)

    def _read_launched(self) -> None:
        """Report the launched quantum once its GPU work is done (never blocks before that)."""
        launched = self._launched
        if launched is None or not launched.pending.done():
            return
        self._launched = None
        task = launched.task
        try:
            result = launched.pending.result()
        except Exception as exc:
            self._done.put(_failed(task, (self.clock() - launched.started) * 1e3, exc))
            return
        duration_ms = result.gpu_ms
        if duration_ms is None:
            duration_ms = (self.clock() - launched.started) * 1e3
        self._done.put(quantum_report(task, result, duration_ms, launched.allocated_before))

    def after_decode(self) -> None:
        return None

    def poll(self) -> list[QuantumReport]:
        self._read_launched()
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
        if self._launched is not None:
            deadline = None if timeout_s is None else time.perf_counter() + timeout_s
            while not self._launched.pending.done():
                if deadline is not None and time.perf_counter() >= deadline:
                    return False
                time.sleep(self.WAIT_POLL_S)
            return True
        return self._finished.wait(timeout_s)

    def close(self) -> None:
        self.wait()
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
        self.wait()
        self._finished.wait()
        self._tasks.put(None)
        self._thread.join()
        sys.setswitchinterval(self._saved_interval)
