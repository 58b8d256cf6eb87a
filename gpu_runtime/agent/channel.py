"""The agent's two links to the broker: its host queue (in) and the control queue (out).

:class:`CommandConsumer` is a kombu consumer of `host.<name>` running in its own thread. It
decodes the Celery task messages the control plane publishes (protocol 2: body
`[args, kwargs, embed]`, header `task`), checks each command, hands it to a callback that only
enqueues it for the engine loop, then acks. It reconnects by itself after a broker restart.

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

from gpu_runtime.agent.protocol import (
    CONTROL_QUEUE,
    HOST_COMMAND_TASK,
    HOST_REPORT_TASK,
    ProtocolError,
    check_command,
    host_queue,
)

logger = logging.getLogger(__name__)


def host_queue_declaration(host: str) -> Queue:
    """The queue exactly as Celery declares it when the control plane publishes to it."""
    name = host_queue(host)
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def decode_task_message(body: Any, headers: dict[str, Any]) -> dict[str, Any]:
    """The command inside a Celery protocol-2 task message; ProtocolError when it is not one."""
    task = headers.get("task")
    if task != HOST_COMMAND_TASK:
        raise ProtocolError(f"host queue got task {task!r}, expected {HOST_COMMAND_TASK!r}")
    if not isinstance(body, (list, tuple)) or len(body) != 3 or not body[0]:
        raise ProtocolError(f"not a Celery protocol-2 body: {body!r:.200}")
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

    def get_consumers(self, consumer_cls: Any, channel: Any) -> list[Any]:
        return [
            consumer_cls(
                queues=[self.queue],
                callbacks=[self._on_message],
                accept=["json"],
                prefetch_count=8,
            )
        ]

    def _on_message(self, body: Any, message: Any) -> None:
        try:
            command = decode_task_message(body, dict(message.headers or {}))
        except ProtocolError as exc:
            logger.error("dropping bad host command: %s", exc)
            message.ack()
            return
        self.on_command(command)
        message.ack()

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="host-queue", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.should_stop = True
        if self.thread is not None:
            self.thread.join(timeout)


class ReportSender:
    """Ordered, at-least-once publisher of reports to the control queue (see module doc)."""

    def __init__(self, broker_url: str, transport_options: dict[str, object] | None = None) -> None:
        self.app = Celery("harli-agent", broker=broker_url, set_as_current=False)
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
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
