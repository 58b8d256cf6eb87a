"""The host-queue consumer on a real `filesystem://` broker: bad messages never end it, and
only commands signed with the host's key reach the engine loop.

Commands are published as the control plane publishes them (a Celery app's `send_task` over the
same transport and folders), or written straight into the queue folder as a damaged file.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Producer
from kombu.transport import filesystem

from gpu_runtime.agent import channel as channel_module
from gpu_runtime.agent.channel import CommandConsumer, ReportSender, host_queue_declaration
from gpu_runtime.agent.outbox import DiskOutbox
from gpu_runtime.contract.broker import broker_transport, broker_transport_options
from gpu_runtime.contract.grants import host_key
from gpu_runtime.contract.message_auth import message_key, message_sign
from gpu_runtime.contract.protocol import (
    CONTROL_QUEUE,
    HOST_COMMAND_TASK,
    HOST_REPORT_TASK,
    host_queue,
    report,
)

URL = "filesystem://"
HOST = "h1"
KEY = message_key(host_key("fleet-secret", HOST))


@pytest.fixture()
def options(tmp_path: Path) -> Iterator[dict[str, object]]:
    filesystem.Transport.global_state.clear()  # bindings of other tests' broker folders
    yield {**broker_transport_options(URL, tmp_path / "broker"), "polling_interval": 0.05}
    filesystem.Transport.global_state.clear()


@pytest.fixture()
def control_plane(options: dict[str, object]) -> Celery:
    app = Celery("control-plane-test", broker=URL, set_as_current=False)
    app.conf.update(broker_transport=broker_transport(URL), broker_transport_options=options,
                    task_serializer="json")  # fmt: skip
    return app


def send(app: Celery, *args: Any, task: str = HOST_COMMAND_TASK, key: bytes | None = KEY) -> None:
    """Publish `args` as the control plane does, each dict signed with `key` (None: as is)."""
    signed = [message_sign(a, key) if key is not None and isinstance(a, dict) else a for a in args]
    app.send_task(task, args=signed, queue=host_queue(HOST), routing_key=host_queue(HOST))


def drain_command(command_id: str) -> dict[str, Any]:
    return {"command": "drain", "command_id": command_id}


class Received:
    """`on_command` for the consumer: records commands; raises for command id `boom`."""

    def __init__(self) -> None:
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()

    def __call__(self, command: dict[str, Any]) -> None:
        if command["command_id"] == "boom":
            raise RuntimeError("handler defect")
        self.commands.put(command)

    def next(self) -> dict[str, Any]:
        return self.commands.get(timeout=15)


def start_consumer(options: dict[str, object], received: Received, cls: type = CommandConsumer):
    connection = Connection(URL, transport=broker_transport(URL), transport_options=options)
    consumer = cls(connection, HOST, received, KEY)
    with connection.clone() as setup:  # the queue exists before anything is published
        host_queue_declaration(HOST)(setup.default_channel).declare()
    consumer.start()
    return consumer


def test_consumer_survives_malformed_commands(
    options: dict[str, object], control_plane: Celery, tmp_path: Path
) -> None:
    received = Received()
    consumer = start_consumer(options, received)
    try:
        send(control_plane, drain_command("before"))
        assert received.next()["command_id"] == "before"
        send(control_plane, drain_command("x"), task="some.other.task")  # wrong task
        send(control_plane, {"command": "launch_missiles", "command_id": "y"})  # unknown command
        send(control_plane, {"command": "drain"})  # no command_id
        send(control_plane)  # no argument
        send(control_plane, {"a": 1}, {"b": 2})  # two arguments
        send(control_plane, drain_command("boom"))  # the handler raises
        with Connection(URL, transport=broker_transport(URL), transport_options=options) as conn:
            declared = host_queue_declaration(HOST)
            Producer(conn.default_channel).publish(  # not JSON although it says so
                b"{not json", exchange=declared.exchange, routing_key=declared.routing_key,
                content_type="application/json", content_encoding="utf-8",
                headers={"task": HOST_COMMAND_TASK},
            )  # fmt: skip
        damaged = tmp_path / "broker" / "queue" / f"{'9' * 20}_x.{host_queue(HOST)}.msg"
        damaged.write_bytes(b'{"body": ')  # a file cut short
        send(control_plane, drain_command("after"))
        assert received.next()["command_id"] == "after"
        deadline = time.monotonic() + 15
        while not (tmp_path / "broker" / "failed" / damaged.name).exists():
            assert time.monotonic() < deadline, "the damaged file was not set aside"
            time.sleep(0.05)
        assert consumer.alive()
        assert consumer.dropped == 7
        assert consumer.unauthenticated == 0
        assert consumer.restarts == 0
        assert received.commands.empty()
    finally:
        consumer.stop()


def test_only_commands_signed_with_the_hosts_key_are_taken(
    options: dict[str, object], control_plane: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    received = Received()
    consumer = start_consumer(options, received)
    other_host = message_key(host_key("fleet-secret", "h2"))
    other_fleet = message_key(host_key("another-secret", HOST))
    altered = message_sign(drain_command("altered"), KEY)
    altered["command"] = "undrain"  # changed after signing
    relabelled = message_sign(drain_command("original"), KEY)
    relabelled["command_id"] = "replayed-under-a-new-id"
    try:
        with caplog.at_level("ERROR", logger="gpu_runtime.agent.channel"):
            send(control_plane, drain_command("unsigned"), key=None)
            send(control_plane, drain_command("h2's"), key=other_host)
            send(control_plane, drain_command("other fleet"), key=other_fleet)
            send(control_plane, altered, key=None)
            send(control_plane, relabelled, key=None)
            send(control_plane, {**drain_command("garbled"), "signature": "v1.zz"}, key=None)
            send(control_plane, drain_command("signed"))
            assert received.next()["command_id"] == "signed"
        assert received.commands.empty()
        assert consumer.unauthenticated == 6 and consumer.dropped == 6
        assert sum("unauthenticated" in r.getMessage() for r in caplog.records) == 6
    finally:
        consumer.stop()


class CrashingConsumer(CommandConsumer):
    """Its consume loop raises on the first `crashes` iterations (a transport defect)."""

    crashes = 1

    def on_iteration(self) -> None:
        if self.crashes > 0:
            self.crashes -= 1
            raise RuntimeError("consume loop defect")


def test_a_crashed_consume_loop_restarts(options: dict[str, object], control_plane: Celery):
    received = Received()
    consumer = start_consumer(options, received, CrashingConsumer)
    try:
        send(control_plane, drain_command("after-restart"))
        assert received.next()["command_id"] == "after-restart"
        assert consumer.restarts == 1
        assert consumer.alive()
    finally:
        consumer.stop()


def test_a_consume_loop_that_keeps_crashing_gives_up(
    options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(channel_module, "CONSUMER_RESTARTS", 2)

    class AlwaysCrashing(CrashingConsumer):
        crashes = 1_000

    consumer = start_consumer(options, Received(), AlwaysCrashing)
    assert consumer.thread is not None
    consumer.thread.join(15)
    assert not consumer.thread.is_alive()
    assert consumer.failed
    assert not consumer.alive()
    assert consumer.restarts == 2


def test_reports_travel_over_the_atomic_transport(
    options: dict[str, object], tmp_path: Path
) -> None:
    sender = ReportSender(URL, options, broker_transport(URL), DiskOutbox(tmp_path / "outbox"))
    with sender.app.connection_for_write() as connection:
        assert type(connection.transport).__module__ == "gpu_runtime.agent.fs_transport"
    sender.start()
    sender.send(report("heartbeat", HOST, free_bytes=1, total_bytes=2, placements=[]))
    sender.stop(timeout=10)
    assert sender.sent == 1
    with Connection(URL, transport=broker_transport(URL), transport_options=options) as conn:
        control = conn.SimpleQueue(CONTROL_QUEUE)
        message = control.get(timeout=5)
        assert message.headers["task"] == HOST_REPORT_TASK
        assert message.payload[0][0]["kind"] == "heartbeat"
        message.ack()
        control.close()
