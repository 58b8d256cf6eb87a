"""The agent's two links to the broker: its host queue (in) and the control queue (out).

:class:`CommandConsumer` is a kombu consumer of `host.<name>` running in its own thread. It
decodes the Celery task messages the control plane publishes (protocol 2: body
`[args, kwargs, embed]`, header `task`), checks each command, hands it to a callback that only
enqueues it for the engine loop, then acks. It reconnects by itself after a broker restart. A
message it cannot decode or check, or whose callback raises, is logged and acked (dropped): no
message ends the thread. Should the consume loop raise anyway (a transport defect), it starts
again after a pause, up to :data:`CONSUMER_RESTARTS` times in :data:`CONSUMER_RESTART_WINDOW_S`;
past that the thread ends with `failed` set, and the agent exits non-zero (`cli.run_agent`), so
a supervisor sees a host that cannot take commands instead of one that heartbeats without them.

:class:`ReportSender` publishes reports to the control queue as Celery tasks from one thread, in
order, from an outbox: a report leaves the outbox only once the broker took it, so a broker
restart delays reports but loses none. Heartbeats are coalesced (only the newest waits).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from celery import Celery
from kombu import Connection, Exchange, Queue
from kombu.mixins import ConsumerMixin

from gpu_runtime.contract.protocol import (
    CONTROL_QUEUE,
    HOST_COMMAND_TASK,
    HOST_REPORT_TASK,
    ProtocolError,
    check_command,
    host_queue,
)

logger = logging.getLogger(__name__)

CONSUMER_RESTARTS = 5
"""Crashes of the consume loop tolerated within :data:`CONSUMER_RESTART_WINDOW_S`."""
CONSUMER_RESTART_WINDOW_S = 60.0


def host_queue_declaration(host: str) -> Queue:
    """The queue exactly as Celery declares it when the control plane publishes to it."""
    name = host_queue(host)
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def decode_task_message(body: Any, headers: dict[str, Any]) -> dict[str, Any]:
    """The command inside a Celery protocol-2 task message; ProtocolError when it is not one."""
    task = headers.get("task")
    if task != HOST_COMMAND_TASK:
        raise ProtocolError(f"host queue got task {task!r}, expected {HOST_COMMAND_TASK!r}")
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        raise ProtocolError(f"not a Celery protocol-2 body: {body!r:.200}")
    if not isinstance(body[0], (list, tuple)) or len(body[0]) != 1:
        raise ProtocolError(f"a host command task has one positional argument: {body!r:.200}")
    return check_command(body[0][0])


class CommandConsumer(ConsumerMixin):
    """Consumes `host.<host>`; each valid command goes to `on_command` (which must not block)."""

    def __init__(
        self,
        connection: Connection,
        host: str,
        on_command: Callable[[dict[str, Any]], None],
    ) -> None:
        self.connection = connection
        self.queue = host_queue_declaration(host)
        self.on_command = on_command
        self.thread: threading.Thread | None = None
        self.dropped = 0
        """Messages dropped as undecodable, malformed or failing in `on_command`."""
        self.restarts = 0
        self.failed = False
        """The consume loop crashed more often than the restart budget allows; it has ended."""

    def get_consumers(self, consumer_cls: Any, channel: Any) -> list[Any]:
        return [
            consumer_cls(
                queues=[self.queue],
                callbacks=[self._on_message],
                on_decode_error=self._on_decode_error,
                accept=["json"],
                prefetch_count=8,
            )
        ]

    def _drop(self, message: Any, reason: str) -> None:
        self.dropped += 1
        logger.error("dropping bad host command (%s): %s", self.queue.name, reason)
        message.ack()

    def _on_decode_error(self, message: Any, exc: Exception) -> None:
        self._drop(message, f"undecodable body ({message.content_type}): {exc}")

    def _on_message(self, body: Any, message: Any) -> None:
        try:
            command = decode_task_message(body, dict(message.headers or {}))
        except Exception as exc:  # ProtocolError, or a header map that is not one
            self._drop(message, f"{type(exc).__name__}: {exc}")
            return
        try:
            self.on_command(command)
        except Exception as exc:  # a defect in the handler must not end the consumer
            logger.exception("host command %s failed to enqueue", command.get("command_id"))
            self._drop(message, f"on_command raised {type(exc).__name__}: {exc}")
            return
        message.ack()

    def _supervise(self) -> None:
        crashes: deque[float] = deque()
        while not self.should_stop:
            try:
                self.run()
                return
            except Exception:
                now = time.monotonic()
                crashes.append(now)
                while crashes and now - crashes[0] > CONSUMER_RESTART_WINDOW_S:
                    crashes.popleft()
                if len(crashes) > CONSUMER_RESTARTS:
                    self.failed = True
                    logger.critical(
                        "host-queue consumer crashed %d times in %.0f s; giving up",
                        len(crashes),
                        CONSUMER_RESTART_WINDOW_S,
                        exc_info=True,
                    )
                    return
                self.restarts += 1
                logger.exception("host-queue consumer crashed; restarting")
                time.sleep(min(0.2 * 2 ** (len(crashes) - 1), 5.0))

    def start(self) -> None:
        self.thread = threading.Thread(target=self._supervise, name="host-queue", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        """The consume thread runs (False once it gave up or ended for any reason)."""
        return self.thread is not None and self.thread.is_alive() and not self.failed

    def stop(self, timeout: float = 5.0) -> None:
        self.should_stop = True
        if self.thread is not None:
            self.thread.join(timeout)


class ReportSender:
    """Ordered, at-least-once publisher of reports to the control queue (see module doc)."""

    def __init__(
        self,
        broker_url: str,
        transport_options: dict[str, object] | None = None,
        transport: str | None = None,
    ) -> None:
        self.app = Celery("harli-agent", broker=broker_url, set_as_current=False)
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            broker_transport=transport,
            broker_transport_options=transport_options or {},
            broker_connection_retry_on_startup=True,
        )
        self._outbox: deque[dict[str, Any]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="report-sender", daemon=True)
        self.sent = 0
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def send(self, message: dict[str, Any]) -> None:
        """Queue a report; a waiting heartbeat is replaced by a newer one."""
        with self._cond:
            if message["kind"] == "heartbeat":
                for i, queued in enumerate(self._outbox):
                    if queued["kind"] == "heartbeat":
                        del self._outbox[i]
                        break
            self._outbox.append(message)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._outbox)

    def _publish(self, message: dict[str, Any]) -> None:
        self.app.send_task(
            HOST_REPORT_TASK,
            args=[message],
            queue=CONTROL_QUEUE,
            routing_key=CONTROL_QUEUE,
            retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.3},
        )

    def _run(self) -> None:
        backoff = 0.2
        while True:
            with self._cond:
                while not self._outbox and not self._stopping:
                    self._cond.wait(0.5)
                if not self._outbox:
                    return
                message = self._outbox[0]
            try:
                self._publish(message)
            except Exception as exc:  # the broker is away: keep the report, try again
                self.failures += 1
                logger.warning("report %s not sent yet: %s", message["kind"], exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.2
            with self._cond:
                if self._outbox and self._outbox[0] is message:
                    self._outbox.popleft()
                self.sent += 1

    def stop(self, timeout: float = 5.0) -> None:
        """Flush what the broker takes within `timeout`, then stop."""
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(max(0.1, deadline - time.monotonic()))
