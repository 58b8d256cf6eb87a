"""Rank 0's ordered messages to the other ranks of its engine group, over the control group.

`DriverChannel.send(message)` on rank 0 and `FollowerChannel.receive()` on ranks 1..N-1:
every message the driver sends reaches every follower once, in send order (a broadcast over
the gloo control group; messages are pickled). The rules:

* One sender: only rank 0 sends, followers only receive; a lock orders the driver's own
  threads (its engine and the keep-alive).
* Keep-alive: once `start_keep_alive` ran, while the driver sends nothing for `heartbeat_s` a
  thread sends `HEARTBEAT` (which `receive` skips), so an idle engine's followers never reach
  the group's collective timeout; a follower whose driver stays silent for that timeout fails
  (its driver is gone).
* Failure: `fail(reason)` (the driver saw a follower die) makes every later `send` raise
  `EngineGroupError` at once instead of waiting on a collective that cannot complete; a send
  whose collective fails marks the channel failed too.

`gather_ready` is the start-up barrier: every rank tells whether it built its part, and every
rank raises the same `EngineGroupError` when one did not.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gpu_runtime.distributed.parallel import TensorParallel


class EngineGroupError(RuntimeError):
    """An engine group cannot go on: a rank failed, died or diverged, or it was shut down."""


@dataclass(frozen=True)
class Heartbeat:
    """The keep-alive message; followers skip it."""


HEARTBEAT = Heartbeat()


class DriverChannel:
    """Rank 0's side (see the module docstring)."""

    def __init__(self, parallel: TensorParallel, heartbeat_s: float = 30.0) -> None:
        if not parallel.is_driver or parallel.size < 2:
            raise ValueError(f"a driver channel is rank 0 of a group of 2 or more, got {parallel}")
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s={heartbeat_s} must be > 0")
        self.parallel = parallel
        self.heartbeat_s = heartbeat_s
        self.failure: str | None = None
        """Why the group failed (None while it is healthy)."""
        self.failed = threading.Event()
        """Set once `failure` is."""
        self.num_sent = 0
        """Messages sent (heartbeats not counted)."""
        self.num_heartbeats = 0
        """Heartbeats sent."""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._last_sent = time.monotonic()
        self._keep_alive: threading.Thread | None = None

    def send(self, message: Any) -> None:
        """Broadcast `message` to every follower (raises `EngineGroupError` once failed or
        closed)."""
        with self._lock:
            self._check()
            self._broadcast(message)
            self.num_sent += 1

    def gather_ready(self, error: str | None) -> None:
        """The start-up barrier (every rank calls `gather_ready` of its side once)."""
        with self._lock:
            gather_ready(self.parallel, error)

    def start_keep_alive(self) -> None:
        """Start the keep-alive thread (after start-up: a follower still loading its model
        would hold a heartbeat's broadcast)."""
        if self._keep_alive is None:
            self._keep_alive = threading.Thread(
                target=self._beat, name="engine-group-keep-alive", daemon=True
            )
            self._keep_alive.start()

    def fail(self, reason: str) -> None:
        """Mark the group failed: later sends raise `EngineGroupError(reason)`."""
        if self.failure is None:
            self.failure = reason
        self.failed.set()

    def close(self, last: Any | None = None) -> None:
        """Send `last` (when given and the group is healthy), then stop sending for good."""
        with self._lock:
            if not self._closed.is_set() and last is not None and self.failure is None:
                try:
                    self._broadcast(last)
                finally:
                    self._closed.set()
            self._closed.set()
        if self._keep_alive is not None:
            self._keep_alive.join()

    def _check(self) -> None:
        if self.failure is not None:
            raise EngineGroupError(self.failure)
        if self._closed.is_set():
            raise EngineGroupError("the engine group is shut down")

    def _broadcast(self, message: Any) -> None:
        try:
            self.parallel.broadcast_object(message)
        except Exception as exc:
            self.fail(f"the control broadcast failed: {exc}")
            raise EngineGroupError(self.failure) from exc
        self._last_sent = time.monotonic()

    def _beat(self) -> None:
        period = self.heartbeat_s
        while not self._closed.wait(period / 4):
            with self._lock:
                if self._closed.is_set() or self.failure is not None:
                    return
                if time.monotonic() - self._last_sent < period:
                    continue
                try:
                    self._broadcast(HEARTBEAT)
                except EngineGroupError:
                    return
                self.num_heartbeats += 1


class FollowerChannel:
    """A follower's side: `receive()` returns the driver's next message."""

    def __init__(self, parallel: TensorParallel) -> None:
        if parallel.is_driver or parallel.size < 2:
            raise ValueError(f"a follower channel is a rank > 0, got {parallel}")
        self.parallel = parallel

    def receive(self) -> Any:
        """The next message other than a heartbeat (blocks; the group's timeout applies)."""
        while True:
            message = self.parallel.broadcast_object(None)
            if not isinstance(message, Heartbeat):
                return message

    def gather_ready(self, error: str | None) -> None:
        """The start-up barrier (see `DriverChannel.gather_ready`)."""
        gather_ready(self.parallel, error)


def gather_ready(parallel: TensorParallel, error: str | None) -> None:
    """Every rank's start-up result; raises `EngineGroupError` on every rank when any rank's
    `error` is not None (naming those ranks and their errors)."""
    errors: list[Any] = [None] * parallel.size
    dist.all_gather_object(errors, error, group=parallel.control_group)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        detail = "\n".join(f"rank {rank}: {e}" for rank, e in failed)
        raise EngineGroupError(f"{len(failed)} rank(s) failed to start:\n{detail}")
