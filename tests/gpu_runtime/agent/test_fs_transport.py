"""The atomic filesystem transport against kombu's stock one, on real broker folders.

Every test publishes and consumes through real kombu connections over a temporary
`filesystem://` broker laid out by `broker_transport_options` (the folders the control plane
and the agents share).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from kombu.simple import SimpleQueue
from kombu.transport import filesystem

from gpu_runtime.agent.fs_transport import TRANSPORT
from gpu_runtime.contract.broker import broker_transport, broker_transport_options

QUEUE = "host.h1"


@pytest.fixture()
def broker_dir(tmp_path: Path) -> Iterator[Path]:
    # kombu keeps the bindings a process declared in one state for every filesystem broker,
    # and skips writing a binding it already holds: forget them, each test has its own folders
    filesystem.Transport.global_state.clear()
    yield tmp_path / "broker"
    filesystem.Transport.global_state.clear()


def connect(broker_dir: Path, transport: str | None) -> Connection:
    options = broker_transport_options("filesystem://", broker_dir)
    return Connection("filesystem://", transport=transport, transport_options=options)


def queue_files(broker_dir: Path) -> list[str]:
    return sorted(os.listdir(broker_dir / "queue"))


@pytest.fixture()
def ours(broker_dir: Path) -> Iterator[SimpleQueue]:
    with connect(broker_dir, TRANSPORT) as connection:
        queue = connection.SimpleQueue(QUEUE)
        yield queue
        queue.close()


def test_filesystem_urls_select_the_atomic_transport() -> None:
    assert broker_transport("filesystem://") == TRANSPORT
    assert broker_transport("redis://127.0.0.1:6379/0") is None
    with Connection("filesystem://", transport=TRANSPORT) as connection:
        assert type(connection.transport).__module__ == "gpu_runtime.agent.fs_transport"
        assert connection.transport.driver_type == "filesystem"


def test_stock_publish_is_visible_before_it_is_written(
    broker_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu's own `_put` creates the file, then writes it: a consumer in between reads ''."""
    created, release = threading.Event(), threading.Event()
    real_lock = filesystem.lock

    def lock_then_pause(file: Any, flags: int) -> None:  # runs between create and write
        real_lock(file, flags)
        if str(file.name).endswith(f".{QUEUE}.msg"):
            created.set()
            assert release.wait(10)

    with connect(broker_dir, None) as setup:  # declare the queue before the race
        setup.SimpleQueue(QUEUE).close()
    monkeypatch.setattr(filesystem, "lock", lock_then_pause)

    def publish() -> None:
        with connect(broker_dir, None) as connection:
            connection.SimpleQueue(QUEUE).put({"command": "pause"})

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        assert created.wait(10)
        [name] = queue_files(broker_dir)
        assert (broker_dir / "queue" / name).stat().st_size == 0  # visible, still empty
        with connect(broker_dir, None) as connection:
            with pytest.raises(json.JSONDecodeError):
                connection.SimpleQueue(QUEUE).get_nowait()
    finally:
        release.set()
        publisher.join(10)


def test_concurrent_consumer_reads_only_complete_messages(broker_dir: Path, ours: Any) -> None:
    total, pad = 400, "x" * 20_000  # large bodies widen any window between create and write
    received: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    published = threading.Event()

    def publish() -> None:
        with connect(broker_dir, TRANSPORT) as connection:
            queue = connection.SimpleQueue(QUEUE)
            for i in range(total):
                queue.put({"i": i, "pad": pad})
            queue.close()
        published.set()

    def consume() -> None:
        try:
            with connect(broker_dir, TRANSPORT) as connection:
                queue = connection.SimpleQueue(QUEUE)
                while len(received) < total:
                    try:
                        message = queue.get_nowait()
                    except queue.Empty:
                        if published.is_set() and not queue_files(broker_dir):
                            break
                        continue
                    received.append(message.payload)
                    message.ack()
                queue.close()
        except BaseException as exc:  # the test reports it below
            errors.append(exc)

    threads = [threading.Thread(target=publish), threading.Thread(target=consume)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert [m["i"] for m in received] == list(range(total))
    assert all(m["pad"] == pad for m in received)
    assert os.listdir(broker_dir / "failed") == []
    assert queue_files(broker_dir) == []  # no temporary or claimed file left behind


def test_corrupt_files_are_set_aside_and_the_next_message_arrives(
    broker_dir: Path, ours: Any, caplog: pytest.LogCaptureFixture
) -> None:
    folder, first_name = broker_dir / "queue", "0" * 20  # sorts before any message published
    corrupt = {
        f"{first_name}_empty.{QUEUE}.msg": b"",
        f"{first_name}_partial.{QUEUE}.msg": b'{"body": "eyJ',
        f"{first_name}_shape.{QUEUE}.msg": b"[1, 2, 3]",
    }
    for name, content in corrupt.items():
        (folder / name).write_bytes(content)
    ours.put({"n": 1})
    ours.put({"n": 2})
    with caplog.at_level(logging.ERROR, logger="gpu_runtime.agent.fs_transport"):
        first = ours.get(timeout=5)
    assert first.payload == {"n": 1}
    first.ack()
    assert sorted(os.listdir(broker_dir / "failed")) == sorted(corrupt)
    for name, content in corrupt.items():
        assert (broker_dir / "failed" / name).read_bytes() == content
        assert name in caplog.text
    second = ours.get(timeout=5)
    assert second.payload == {"n": 2}
    second.ack()
    assert queue_files(broker_dir) == []


def test_temporary_names_are_invisible_to_stock_and_ours(broker_dir: Path, ours: Any) -> None:
    """A publish in progress (our dot-prefixed temporary name) is no message to any consumer."""
    (broker_dir / "queue" / f".1_x.{QUEUE}.msg.tmp").write_bytes(b'{"half": ')
    assert ours.qsize() == 0
    with pytest.raises(ours.Empty):
        ours.get_nowait()
    with connect(broker_dir, None) as connection:
        stock = connection.SimpleQueue(QUEUE)
        assert stock.qsize() == 0
        with pytest.raises(stock.Empty):
            stock.get_nowait()
    assert queue_files(broker_dir) == [f".1_x.{QUEUE}.msg.tmp"]


def test_concurrent_binds_to_a_new_exchange_keep_every_queue(broker_dir: Path) -> None:
    """The binding table is created whole: no binder truncates another's entry."""
    names = [f"q{i}" for i in range(8)]
    start = threading.Barrier(len(names))
    errors: list[BaseException] = []

    def bind(queue: str) -> None:
        try:
            with connect(broker_dir, TRANSPORT) as connection:
                channel = connection.default_channel
                start.wait(10)
                channel._queue_bind("fan", queue, "", queue)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=bind, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    with connect(broker_dir, TRANSPORT) as connection:
        table = connection.default_channel.get_table("fan")
    assert sorted(q.queue for q in table) == names
    assert [n for n in os.listdir(broker_dir / "control") if n.startswith(".")] == []
