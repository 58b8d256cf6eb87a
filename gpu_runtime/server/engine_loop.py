"""Runs an `Engine` in its own thread and streams outputs to asyncio consumers.

The engine is not thread-safe, so only the loop thread touches it: submissions, aborts and
`run_in_loop` calls (e.g. registering an adapter) are queued and run between steps, and outputs
are handed to each request's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.request import RequestOutput, SamplingParams


@dataclass
class _Submission:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    lora_name: str | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


class EngineLoop:
    """Owns the engine thread. `generate` is the async API the server uses."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Submission | _Call | str | None] = queue.Queue()
        self._streams: dict[str, _Submission] = {}
        self._ids = itertools.count()
        self._idle_wait_s = idle_wait_s
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop thread and fail pending streams."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, lora_name: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step until it finishes; aborts it when the
        consumer stops early. Raises ValueError when the engine rejects the request."""
        if self._thread is None:
            raise RuntimeError("EngineLoop.start() was not called")
        request_id = f"srv-{next(self._ids)}"
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._inbox.put(_Submission(request_id, list(prompt), params, lora_name, loop, stream))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(request_id)

    def run_in_loop(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn()` on the loop thread between two steps (where touching the engine and its
        LoRA runtime is safe); the future holds its result or exception. Needs `start()`."""
        if self._thread is None:
            raise RuntimeError("EngineLoop.start() was not called")
        future: Future[Any] = Future()
        self._inbox.put(_Call(fn, future))
        return future

    def _deliver(self, submission: _Submission, item: RequestOutput | BaseException) -> None:
        submission.loop.call_soon_threadsafe(submission.outputs.put_nowait, item)

    def _drain_inbox(self, block: bool) -> None:
        item: _Submission | _Call | str | None
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Submission):
                try:
                    self.engine.add_request(
                        item.prompt, item.params, item.request_id, item.lora_name
                    )
                    self._streams[item.request_id] = item
                except ValueError as exc:
                    self._deliver(item, exc)
            elif isinstance(item, _Call):
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn())
                    except BaseException as exc:  # handed to the caller through the future
                        item.future.set_exception(exc)
            elif isinstance(item, str):
                self.engine.abort_request(item)
                self._streams.pop(item, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_inbox(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # fail every stream rather than hang them
                for submission in self._streams.values():
                    self._deliver(submission, RuntimeError(f"engine step failed: {exc}"))
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                self._streams.clear()
                time.sleep(self._idle_wait_s)
                continue
            self.steps += 1
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is None:
                    continue
                self._deliver(target, out if out.error is None else ValueError(out.error))
                if out.finished:
                    del self._streams[out.request_id]
        for submission in self._streams.values():
            self._deliver(submission, RuntimeError("engine loop stopped"))
        while True:  # calls queued after the last drain would otherwise never complete
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(RuntimeError("engine loop stopped"))
