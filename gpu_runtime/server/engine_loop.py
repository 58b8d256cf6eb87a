"""Runs an `Engine` (or a host's co-location loop around one) in its own thread and streams
outputs to asyncio consumers.

The engine is not thread-safe, so only the loop thread touches it: submissions, aborts and
`run_in_loop` calls (e.g. registering an adapter, a host command) are queued and run between
steps, and outputs are handed to each request's asyncio queue with `call_soon_threadsafe`.

What the thread steps is a :class:`StepDriver`: :class:`EngineDriver` steps the engine alone;
a host agent passes its own driver, whose `step()` runs one co-location iteration (decode plus
finetune quanta), so inference and training share the one engine thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class StepDriver(Protocol):
    """What the loop thread drives. Every method runs on the loop thread only.

    - `engine`: the engine requests go to (read per request by the server: tokenizer, limits,
      LoRA runtime); a driver may replace it between steps when it holds no request.
    - `add_request` / `abort_request`: as `Engine.add_request` / `abort_request` (ValueError
      for a request the engine refuses); `tenant` is the caller the engine's admission is
      fair across.
    - `has_work()`: True when `step()` should run now; otherwise the thread waits (briefly) for
      submissions.
    - `step()`: one step; returns the request outputs it produced. An exception fails every
      open stream (the driver has already cleaned up its own state).
    - `after_turn()`: housekeeping after every turn of the thread, idle or not.
    - `close()`: the thread is stopping.
    """

    @property
    def engine(self) -> Engine: ...

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        lora_name: str | None,
        tenant: str = "",
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def after_turn(self) -> None: ...

    def close(self) -> None: ...


class EngineDriver:
    """Steps one engine alone (the stand-alone server)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine(self) -> Engine:
        return self._engine

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        lora_name: str | None,
        tenant: str = "",
    ) -> None:
        self._engine.add_request(prompt, params, request_id, lora_name, tenant=tenant)

    def abort_request(self, request_id: str) -> None:
        self._engine.abort_request(request_id)

    def has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self._engine.step()

    def after_turn(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Submission:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    lora_name: str | None
    tenant: str
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]
    open_sequences: int = 1
    """Sequences not finished yet (`params.n` at first: a fan-out's children)."""


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


class EngineLoop:
    """Owns the engine thread. `generate` is the async API the server uses."""

    def __init__(
        self,
        target: Engine | StepDriver,
        idle_wait_s: float = 0.05,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        """`on_step`, when given, is called on the loop thread with each step's wall time in
        seconds (the stand-alone server's iteration histogram)."""
        self.driver: StepDriver = EngineDriver(target) if isinstance(target, Engine) else target
        self._inbox: queue.Queue[_Submission | _Call | str | None] = queue.Queue()
        self._streams: dict[str, _Submission] = {}
        self._ids = itertools.count()
        self._idle_wait_s = idle_wait_s
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0
        self._on_step = on_step

    @property
    def engine(self) -> Engine:
        """The driver's engine now (a host may swap it when it loads another base model)."""
        return self.driver.engine

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
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        lora_name: str | None = None,
        tenant: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs step by step until it finishes (with `params.n > 1`:
        its n sequences' outputs, told apart by `RequestOutput.index`, until each finished);
        aborts it when the consumer stops early. `tenant` is who asked (admission is fair
        across tenants). Raises ValueError when the engine rejects the request."""
        if self._thread is None:
            raise RuntimeError("EngineLoop.start() was not called")
        request_id = f"srv-{next(self._ids)}"
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        submission = _Submission(
            request_id, list(prompt), params, lora_name, tenant, loop, stream, params.n
        )
        self._inbox.put(submission)
        finished = False
        open_sequences = params.n
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    open_sequences -= 1
                finished = open_sequences == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(request_id)

    def run_in_loop(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn()` on the loop thread between two steps (where touching the engine and its
        LoRA runtime is safe); the future holds its result or exception. Calls queued before
        `start()` run once the thread starts."""
        future: Future[Any] = Future()
        self._inbox.put(_Call(fn, future))
        return future

    @property
    def open_streams(self) -> int:
        """Requests submitted and not finished (read on the loop thread)."""
        return len(self._streams)

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
                    self.driver.add_request(
                        item.prompt, item.params, item.request_id, item.lora_name, item.tenant
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
                if self._streams.pop(item, None) is not None:
                    self.driver.abort_request(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._turn()
        finally:
            for submission in self._streams.values():
                self._deliver(submission, RuntimeError("engine loop stopped"))
            self._streams.clear()
            try:
                self.driver.close()
            except Exception:
                logger.exception("closing the engine loop's driver failed")
            while True:  # calls queued after the last drain would otherwise never complete
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                    item.future.set_exception(RuntimeError("engine loop stopped"))

    def _turn(self) -> None:
        self._drain_inbox(block=not self.driver.has_work())
        if self.driver.has_work():
            self._step()
        try:
            self.driver.after_turn()
        except Exception:  # housekeeping must not stop serving
            logger.exception("engine loop housekeeping failed")

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.driver.step()
        except Exception as exc:  # fail every stream rather than hang them
            logger.exception("engine step failed")
            for request_id, submission in self._streams.items():
                self._deliver(submission, RuntimeError(f"engine step failed: {exc}"))
                self.driver.abort_request(request_id)
            self._streams.clear()
            time.sleep(self._idle_wait_s)
            return
        self.steps += 1
        if self._on_step is not None:
            self._on_step(time.perf_counter() - started)
        for out in outputs:
            key = out.parent_id or out.request_id  # a fan-out's children share its stream
            target = self._streams.get(key)
            if target is None:
                continue
            self._deliver(target, out if out.error is None else ValueError(out.error))
            if out.error is not None:
                del self._streams[key]
                self.driver.abort_request(key)  # its siblings, if any
            elif out.finished:
                target.open_sequences -= 1
                if target.open_sequences == 0:
                    del self._streams[key]
