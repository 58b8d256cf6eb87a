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
