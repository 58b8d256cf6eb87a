"""The agent's two links to the broker: its host queue (in) and the control queue (out).

:class:`CommandConsumer` is a kombu consumer of `host.<name>` running in its own thread. It
decodes the Celery task messages the control plane publishes (protocol 2: body
`[args, kwargs, embed]`, header `task`), verifies each command's signature under the host's
message key (`gpu_runtime.contract.message_auth`) and checks it, hands it to a callback that
only enqueues it for the engine loop, then acks. It reconnects by itself after a broker restart. A
message it cannot decode, verify or check, or whose callback raises, is logged and acked
(dropped; an unsigned or forged one is also counted in `unauthenticated`): no message ends the
thread. Should the consume loop raise anyway (a transport defect), it starts
again after a pause, up to :data:`CONSUMER_RESTARTS` times in :data:`CONSUMER_RESTART_WINDOW_S`;
past that the thread ends with `failed` set, and the agent exits non-zero (`cli.run_agent`), so
a supervisor sees a host that cannot take commands instead of one that heartbeats without them.

:class:`ReportSender` publishes reports to the control queue as Celery tasks from one thread, in
order, from the durable outbox (`gpu_runtime.agent.outbox`): `send` builds a report's task
message and writes it to local disk before returning; the thread publishes it and removes it
only once the broker confirmed it (Redis and the `filesystem://` transport answer each publish
synchronously; an AMQP broker is asked for publisher confirms, `confirm_publish`). A broker
restart delays reports, an agent crash only postpones them to the next start, which sends
what was left first, in order. Heartbeats are coalesced in memory (only the newest waits).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.app.amqp import task_message
from kombu import Connection, Exchange, Queue
from kombu.mixins import ConsumerMixin

from gpu_runtime.agent.outbox import DiskOutbox, OutboxEntry, OutboxStats
from gpu_runtime.contract.message_auth import MessageAuthError, message_verify
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


def decode_task_message(body: Any, headers: dict[str, Any], key: bytes) -> dict[str, Any]:
    """The command inside a Celery protocol-2 task message, its signature verified under the
    host's message `key` and removed; ProtocolError when it is not one, MessageAuthError when
    it is unsigned or its signature is not `key`'s."""
    task = headers.get("task")
    if task != HOST_COMMAND_TASK:
        raise ProtocolError(f"host queue got task {task!r}, expected {HOST_COMMAND_TASK!r}")
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        raise ProtocolError(f"not a Celery protocol-2 body: {body!r:.200}")
    if not isinstance(body[0], (list, tuple)) or len(body[0]) != 1:
        raise ProtocolError(f"a host command task has one positional argument: {body!r:.200}")
    return check_command(message_verify(body[0][0], key))


class CommandConsumer(ConsumerMixin):
    """Consumes `host.<host>`; each valid command signed with `key` (the host's message key)
    goes to `on_command` (which must not block)."""

    def __init__(
        self,
        connection: Connection,
        host: str,
        on_command: Callable[[dict[str, Any]], None],
        key: bytes,
    ) -> None:
        self.connection = connection
        self.queue = host_queue_declaration(host)
        self.on_command = on_command
        self.key = key
        self.unauthenticated = 0
        """Commands dropped as unsigned or not signed with this host's key (also in `dropped`)."""
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
            command = decode_task_message(body, dict(message.headers or {}), self.key)
        except MessageAuthError as exc:
            self.unauthenticated += 1
            self._drop(message, f"unauthenticated: {exc}")
            return
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


CONFIRMING_SCHEMES = ("amqp", "amqps", "pyamqp")
"""Broker URL schemes whose publish returns before the broker took the message unless
publisher confirms are on (py-amqp's `confirm_publish`)."""
CONFIRM_TIMEOUT_S = 10.0
"""How long a publish waits for an AMQP broker's confirmation before it counts as failed."""


def build_task_message(app: Celery, message: dict[str, Any]) -> dict[str, Any]:
    """The Celery protocol-2 task message of one report, as it is persisted and published:
    `{"headers", "properties", "body"}`. Its task id is the report's message id."""
    built = app.amqp.as_task_v2(message["message_id"], HOST_REPORT_TASK, args=[message], kwargs={})
    return {"headers": built.headers, "properties": built.properties, "body": built.body}


class ReportSender:
    """Ordered, at-least-once publisher of reports to the control queue (see module doc)."""

    def __init__(
        self,
        broker_url: str,
        transport_options: dict[str, object] | None,
        transport: str | None,
        outbox: DiskOutbox,
    ) -> None:
        options = dict(transport_options or {})
        self.confirms = broker_url.partition(":")[0].partition("+")[0] in CONFIRMING_SCHEMES
        if self.confirms:
            options["confirm_publish"] = True
        self.app = Celery("harli-agent", broker=broker_url, set_as_current=False)
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            broker_transport=transport,
            broker_transport_options=options,
            broker_connection_retry_on_startup=True,
        )
        self.outbox = outbox
        self._queue: deque[OutboxEntry] = deque(outbox.recover())
        """What waits to be sent, in order: what a previous run left first."""
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="report-sender", daemon=True)
        self.sent = 0
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def send(self, message: dict[str, Any]) -> None:
        """Persist a report and queue it (returns once it is on disk); a waiting heartbeat is
        replaced by a newer one. A report the outbox refused is counted there and logged."""
        task = build_task_message(self.app, message)
        with self._cond:
            entry = self.outbox.put(message["kind"], message["message_id"], task)
            if entry is None:
                return
            if entry.kind == "heartbeat":
                for i, queued in enumerate(self._queue):
                    if queued.kind == "heartbeat":
                        del self._queue[i]
                        break
            self._queue.append(entry)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def stats(self) -> OutboxStats:
        """The outbox's counters (a copy)."""
        with self._cond:
            stats = self.outbox.stats
            return OutboxStats(**{**vars(stats), "dropped": dict(stats.dropped)})

    def _publish(self, entry: OutboxEntry) -> None:
        """Publish `entry` as it was persisted; returns once the broker took it."""
        task = entry.task
        built = task_message(dict(task["headers"]), dict(task["properties"]), task["body"], None)
        with self.app.producer_or_acquire() as producer:
            self.app.amqp.send_task_message(
                producer,
                HOST_REPORT_TASK,
                built,
                queue=CONTROL_QUEUE,
                routing_key=CONTROL_QUEUE,
                retry=True,
                retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.3},
                confirm_timeout=CONFIRM_TIMEOUT_S if self.confirms else None,
            )

    def _run(self) -> None:
        backoff = 0.2
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait(0.5)
                if not self._queue:
                    return
                entry = self._queue[0]
            try:
                self._publish(entry)
            except Exception as exc:  # the broker is away or refused it: keep it, try again
                self.failures += 1
                logger.warning("report %s not sent yet: %s", entry.kind, exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.2
            with self._cond:
                self.outbox.remove(entry)
                if self._queue and self._queue[0] is entry:
                    self._queue.popleft()
                self.sent += 1

    def stop(self, timeout: float = 5.0) -> None:
        """Flush what the broker takes within `timeout`, then stop; what is left stays in the
        outbox for the next start."""
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(max(0.1, deadline - time.monotonic()))
