"""A persistent `ThreadedExecutor` serves loops one after another on one worker thread."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from gpu_runtime.colocation.executor import QuantumTask, ThreadedExecutor
from gpu_runtime.colocation.types import LaunchMode


class _ThreadRecordingTrainer:
    """Stands in for a trainer: records which thread ran each quantum."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.threads: list[int] = []

    def step_quantum(self, max_tokens: int, **_: Any) -> SimpleNamespace:
        self.threads.append(threading.get_ident())
        return SimpleNamespace(
            tokens=max_tokens,
            loss=1.0,
            step=len(self.threads),
            optimizer_step=False,
            finished=False,
            peak_memory_bytes=None,
            checkpoint=None,
        )


def _run_one(executor: ThreadedExecutor, trainer: Any) -> int:
    executor.submit(QuantumTask("job", trainer, 64, LaunchMode.CONCURRENT, None))
    assert executor.wait(5.0)
    (report,) = executor.poll()
    return report.tokens


def test_persistent_executor_keeps_its_thread_across_close() -> None:
    trainer = _ThreadRecordingTrainer()
    executor = ThreadedExecutor(time.perf_counter, persistent=True)
    assert _run_one(executor, trainer) == 64
    executor.close()  # one loop done: the thread stays for the next
    assert _run_one(executor, trainer) == 64
    executor.close()
    assert len(set(trainer.threads)) == 1 and trainer.threads[0] != threading.get_ident()
    executor.shutdown()
    assert not executor._thread.is_alive()


def test_plain_executor_stops_its_thread_on_close() -> None:
    executor = ThreadedExecutor(time.perf_counter)
    assert _run_one(executor, _ThreadRecordingTrainer()) == 64
    executor.close()
    assert not executor._thread.is_alive()


class _LaunchedQuantum:
    """Stands in for a launched quantum: done once ``gpu_done`` is set."""

    def __init__(self, tokens: int) -> None:
        self.gpu_done = threading.Event()
        self.tokens = tokens
        self.reads = 0

    def done(self) -> bool:
        return self.gpu_done.is_set()

    def result(self) -> SimpleNamespace:
        assert self.done(), "read before the GPU finished"
        self.reads += 1
        return SimpleNamespace(
            tokens=self.tokens,
            loss=2.0,
            step=1,
            optimizer_step=True,
            finished=False,
            peak_memory_bytes=None,
            checkpoint=None,
            gpu_ms=12.5,
        )


class _GraphedTrainer(_ThreadRecordingTrainer):
    """Stands in for a trainer whose micro-batches replay CUDA graphs."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.graphs = SimpleNamespace(disabled=None)
        self.launched: list[_LaunchedQuantum] = []
        self.fail = fail

    def start_quantum(self, max_tokens: int) -> _LaunchedQuantum:
        self.threads.append(threading.get_ident())
        if self.fail:
            raise RuntimeError("capture failed")
        self.launched.append(_LaunchedQuantum(max_tokens))
        return self.launched[-1]


def test_graphed_quanta_launch_on_the_calling_thread_and_are_read_once_done() -> None:
    trainer: Any = _GraphedTrainer()
    executor = ThreadedExecutor(time.perf_counter)
    executor.submit(QuantumTask("job", trainer, 256, LaunchMode.CONCURRENT, 48))
    assert trainer.threads == [threading.get_ident()]  # no hand-over to the worker thread
    assert executor.in_flight is not None
    assert executor.poll() == []  # still running on the GPU: nothing read, nothing waited for
    assert not executor.wait(0.01)
    (quantum,) = trainer.launched
    assert quantum.reads == 0
    quantum.gpu_done.set()
    assert executor.wait(0.01)
    (report,) = executor.poll()
    assert (report.tokens, report.duration_ms, report.decode_sms) == (256, 12.5, 48)
    assert report.error is None and quantum.reads == 1
    assert executor.in_flight is None and executor.poll() == []
    executor.close()


def test_a_graphed_launch_that_raises_becomes_a_failed_report() -> None:
    executor = ThreadedExecutor(time.perf_counter)
    failing: Any = _GraphedTrainer(fail=True)
    executor.submit(QuantumTask("job", failing, 64, LaunchMode.CONCURRENT, 48))
    (report,) = executor.poll()
    assert report.tokens == 0 and report.error == "RuntimeError: capture failed"
    executor.close()


def test_disabled_graphs_and_layer_slices_go_to_the_worker_thread() -> None:
    trainer = _GraphedTrainer()
    trainer.graphs.disabled = "capture failed: ..."
    executor = ThreadedExecutor(time.perf_counter)
    assert _run_one(executor, trainer) == 64
    sliced: Any = _GraphedTrainer()
    executor.submit(QuantumTask("job", sliced, 64, LaunchMode.CONCURRENT, None, max_layers=2))
    assert executor.wait(5.0)
    (report,) = executor.poll()
    assert report.tokens == 64 and not sliced.launched
    executor.close()
    main = threading.get_ident()
    assert trainer.threads[0] != main and sliced.threads[0] != main
