"""The durable outbox of reports (`gpu_runtime.agent.outbox`) and the sender over it.

Files on a real disk; the crash tests run a sender in a child process (`outbox_child`) against
the real Redis and RabbitMQ of the test services, kill it with SIGKILL while the broker is
unreachable or between the broker's confirmation and the outbox forgetting the report, start
it again on the same directory, and read the control queue.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from gpu_runtime.agent import outbox as outbox_module
from gpu_runtime.agent.channel import ReportSender, build_task_message
from gpu_runtime.agent.outbox import CORRUPT_FOLDER, DiskOutbox, OutboxBusyError
from gpu_runtime.contract.protocol import CONTROL_QUEUE, HOST_REPORT_TASK, report
from tests.services import AMQP_URL_ENV, REDIS_URL_ENV, service_url

ROOT = Path(__file__).resolve().parents[3]
HOST = "h1"
BROKERS = {"redis": REDIS_URL_ENV, "rabbitmq": AMQP_URL_ENV}
"""The shared Redis and RabbitMQ, as the suite's own users (`tests.services`)."""
UNREACHABLE = {
    "redis": "redis://harli-test:unused@127.0.0.1:1/14",
    "rabbitmq": "amqp://harli-test:unused@127.0.0.1:1/harli-test",
}


def broker_url(name: str) -> str:
    """The URL of broker `name` with the suite's credentials (Redis: database 14)."""
    url = service_url(BROKERS[name])
    return url.rsplit("/", 1)[0] + "/14" if name == "redis" else url
APP = Celery("outbox-test", broker="memory://", set_as_current=False)


def progress(step: int) -> dict[str, Any]:
    return report("job_progress", HOST, placement_id=1, job_id="ftjob-1", step=step,
                  train_loss=1.0)  # fmt: skip


def heartbeat(free: int) -> dict[str, Any]:
    return report("heartbeat", HOST, free_bytes=free, total_bytes=10, placements=[])


def succeeded() -> dict[str, Any]:
    return report("job_succeeded", HOST, placement_id=1, job_id="ftjob-1", trained_tokens=9,
                  adapter_key="adapters/ftjob-1")  # fmt: skip


def put(outbox: DiskOutbox, message: dict[str, Any]) -> Any:
    return outbox.put(message["kind"], message["message_id"], build_task_message(APP, message))


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".json"))


def steps(entries: list[Any]) -> list[int]:
    return [e.task["body"][0][0]["step"] for e in entries]


def test_a_report_is_on_disk_as_built_before_put_returns_and_recovered_in_order(
    tmp_path: Path,
) -> None:
    outbox = DiskOutbox(tmp_path / "outbox")
    messages = [progress(step) for step in (1, 2, 3)]
    entries = [put(outbox, m) for m in messages]
    assert [e.seq for e in entries] == [0, 1, 2]
    names = files(tmp_path / "outbox")
    assert names == [f"{i:016d}.{m['message_id']}.json" for i, m in enumerate(messages)]
    record = json.loads((tmp_path / "outbox" / names[0]).read_bytes())
    assert record["task"]["headers"]["task"] == HOST_REPORT_TASK
    assert record["task"]["headers"]["id"] == messages[0]["message_id"]
    assert record["task"]["body"][0] == [messages[0]]
    assert entries[0].task == record["task"]  # what is published is what was written
    outbox.close()

    again = DiskOutbox(tmp_path / "outbox")
    recovered = again.recover()
    assert steps(recovered) == [1, 2, 3]
    assert [e.task for e in recovered] == [e.task for e in entries]
    assert again.stats.recovered == 3 and again.stats.depth == 3
    assert put(again, progress(4)).seq == 3  # the sequence continues after what was left
    again.remove(recovered[0])
    assert again.stats.depth == 3 and len(files(tmp_path / "outbox")) == 3


def test_heartbeats_are_never_written_and_only_the_newest_waits(tmp_path: Path) -> None:
    outbox = DiskOutbox(tmp_path / "outbox")
    sender = ReportSender("memory://", {}, None, outbox)  # not started: nothing leaves
    sender.send(heartbeat(1))
    sender.send(progress(1))
    sender.send(heartbeat(2))
    assert sender.pending() == 2
    assert [e.kind for e in sender._queue] == ["job_progress", "heartbeat"]
    assert sender._queue[1].task["body"][0][0]["free_bytes"] == 2
    assert len(files(tmp_path / "outbox")) == 1  # the progress report only
    outbox.close()
    assert [e.kind for e in DiskOutbox(tmp_path / "outbox").recover()] == ["job_progress"]


def test_a_full_outbox_refuses_progress_and_metrics_but_keeps_job_outcomes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = DiskOutbox(tmp_path / "outbox", max_messages=2)
    assert put(outbox, progress(1)) is not None
    assert put(outbox, progress(2)) is not None
    assert put(outbox, progress(3)) is None
    metrics = report("metrics", HOST, window_s=5, host_metrics={}, deployment_metrics=None)
    assert put(outbox, metrics) is None
    kept = put(outbox, succeeded())
    assert kept is not None and kept.path is not None and kept.path.exists()
    assert outbox.stats.dropped == {"job_progress": 1, "metrics": 1}
    assert outbox.stats.over_bound == 1 and outbox.stats.depth == 3
    assert "refused: the outbox is full" in caplog.text
    assert "written past the bound" in caplog.text

    by_bytes = DiskOutbox(tmp_path / "small", max_bytes=1)
    assert put(by_bytes, progress(1)) is None
    assert put(by_bytes, succeeded()) is not None


def test_a_write_the_disk_refuses_keeps_a_job_outcome_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_space(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    outbox = DiskOutbox(tmp_path / "outbox")
    monkeypatch.setattr(outbox_module, "_write_durably", no_space)
    assert put(outbox, progress(1)) is None
    kept = put(outbox, succeeded())
    assert kept is not None and kept.path is None  # sent from memory, not dropped
    assert outbox.stats.unpersisted == 1 and outbox.stats.dropped == {"job_progress": 1}
    assert "sent from memory only" in caplog.text


def test_recovery_removes_cut_writes_and_sets_aside_damaged_files(tmp_path: Path) -> None:
    directory = tmp_path / "outbox"
    outbox = DiskOutbox(directory)
    good = put(outbox, progress(1))
    outbox.close()
    (directory / f".{'0' * 15}1.abc.json.tmp").write_bytes(b'{"kind": ')  # a write cut short
    damaged = directory / f"{'0' * 15}2.def.json"
    damaged.write_bytes(b'{"kind": "job_progress"}')  # no task
    again = DiskOutbox(directory)
    assert [e.message_id for e in again.recover()] == [good.message_id]
    assert again.stats.corrupt == 1
    assert (directory / CORRUPT_FOLDER / damaged.name).exists()
    left = sorted(p.name for p in directory.iterdir() if p.is_file())
    assert left == sorted(["lock", good.path.name])


def test_one_process_owns_an_outbox(tmp_path: Path) -> None:
    directory = tmp_path / "outbox"
    held = DiskOutbox(directory)
    with pytest.raises(OutboxBusyError, match="in use by another process"):
        DiskOutbox(directory)
    held.close()
    DiskOutbox(directory).close()


# ---- crashes of a real sender process against real brokers


@pytest.fixture(params=sorted(BROKERS))
def broker(request: pytest.FixtureRequest) -> Iterator[str]:
    """A broker kind whose control queue is empty before and after the test."""
    name = request.param
    try:
        with Connection(broker_url(name), connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # the test services are not running
        pytest.fail(f"{name} does not answer the suite's user (scripts/services.sh): {exc}")
    clear_control_queue(broker_url(name))
    yield name
    clear_control_queue(broker_url(name))


def clear_control_queue(url: str) -> None:
    with Connection(url) as conn:
        queue = conn.SimpleQueue(CONTROL_QUEUE)
        queue.clear()
        queue.close()


def control_queue(url: str, count: int) -> list[dict[str, Any]]:
    """`count` reports taken from the control queue (task headers checked), in order."""
    taken: list[dict[str, Any]] = []
    with Connection(url) as conn:
        queue = conn.SimpleQueue(CONTROL_QUEUE)
        try:
            for _ in range(count):
                message = queue.get(timeout=15)
                assert message.headers["task"] == HOST_REPORT_TASK
                assert message.headers["id"] == message.payload[0][0]["message_id"]
                taken.append(message.payload[0][0])
                message.ack()
            with pytest.raises(queue.Empty):
                queue.get(timeout=0.5)  # nothing more
        finally:
            queue.close()
    return taken


class Child:
    """`outbox_child` in its own process group, its output read line by line."""

    def __init__(self, *args: object) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu_runtime.agent.outbox_child", *map(str, args)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip

    def wait_for(self, line: str, timeout: float = 60.0) -> None:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            got = self.popen.stdout.readline().strip()
            if got == line:
                return
            if not got and self.popen.poll() is not None:
                break
            seen.append(got)
        raise AssertionError(f"the sender never printed {line!r}; it printed {seen}")

    def kill(self) -> None:
        os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        assert self.popen.returncode == -signal.SIGKILL


@pytest.fixture()
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        if child.popen.poll() is None:
            child.kill()


def test_reports_queued_while_the_broker_is_away_survive_sigkill_and_go_first(
    broker: str, tmp_path: Path, children: list[Child]
) -> None:
    directory = tmp_path / "outbox"
    first = Child(UNREACHABLE[broker], directory, 1, 5)
    children.append(first)
    first.wait_for("queued 5")
    first.kill()
    assert len(files(directory)) == 5

    second = Child(broker_url(broker), directory, 6, 2)  # restarted on the same outbox
    children.append(second)
    second.wait_for("flushed")
    reports = control_queue(broker_url(broker), 7)
    assert [r["step"] for r in reports] == [1, 2, 3, 4, 5, 6, 7]
    assert len({r["message_id"] for r in reports}) == 7
    assert files(directory) == []


def test_a_crash_between_the_confirmation_and_the_removal_resends_the_same_message(
    broker: str, tmp_path: Path, children: list[Child]
) -> None:
    directory = tmp_path / "outbox"
    first = Child(broker_url(broker), directory, 1, 3, 2)  # holds after step 2 was confirmed
    children.append(first)
    first.wait_for("published 2")
    first.kill()

    second = Child(broker_url(broker), directory, 4, 1)
    children.append(second)
    second.wait_for("flushed")
    reports = control_queue(broker_url(broker), 5)
    assert [r["step"] for r in reports] == [1, 2, 2, 3, 4]
    assert reports[1] == reports[2]  # the very message (its id: the control plane skips it)
    assert len({r["message_id"] for r in reports}) == 4
    assert files(directory) == []


def test_an_amqp_sender_publishes_with_publisher_confirms(broker: str, tmp_path: Path) -> None:
    sender = ReportSender(broker_url(broker), {}, None, DiskOutbox(tmp_path / "outbox"))
    with sender.app.connection_for_write() as conn:
        channel = conn.default_channel
        if broker == "rabbitmq":  # publish waits for the broker's basic.ack
            assert sender.confirms and conn.connection.confirm_publish is True
            assert channel.basic_publish == channel.basic_publish_confirm
        else:  # Redis answers every LPUSH before publish returns
            assert not sender.confirms
