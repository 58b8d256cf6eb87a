"""The control plane's report intake (`workers.host_report`) trusts a report only when its host's
key signed it, and stores a storage key only under the report's own job's prefix; commands it
sends carry its host's signature."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from kombu import Connection

from api.models import FinetuneJob, GpuHost, JobCheckpoint, JobStatus, Placement, ProcessedReport
from api.services.placement import job_place
from gpu_runtime.agent.channel import host_queue_declaration
from gpu_runtime.contract.message_auth import MessageAuthError, message_sign, message_verify
from gpu_runtime.contract.protocol import adapter_key, checkpoint_key, new_message_id
from tests.api.services.conftest import drain_host_queue, heartbeat, make_host
from workers.commands import send_host_command
from workers.message_keys import host_message_key
from workers.tasks import host_report

pytestmark = pytest.mark.django_db


@pytest.fixture
def placed(deployment: Any, job: FinetuneJob, django_capture_on_commit_callbacks: Any) -> Placement:
    """`job` placed on h1 (h2 serves the same model); the host queues are empty."""
    for name in ("h1", "h2"):
        make_host(name, deployment)
        heartbeat(name, harvestable_tokens_per_s=100.0 if name == "h1" else 1.0)
    with django_capture_on_commit_callbacks(execute=True):
        placement = job_place(job_id=job.id)
    assert placement is not None and placement.host.name == "h1"
    for name in ("h1", "h2"):
        drain_host_queue(name)
    return placement


def _report(kind: str, placement: Placement, **fields: Any) -> dict[str, Any]:
    """A report of `placement`'s host, unchecked (so a bad one can be built) and unsigned."""
    return {"message_id": new_message_id(), "kind": kind, "host": placement.host.name,
            "sent_at": time.time(), "placement_id": placement.pk, "job_id": placement.job_id,
            **fields}  # fmt: skip


def _signed(message: dict[str, Any], host: str = "h1") -> dict[str, Any]:
    return message_sign(message, host_message_key(host))


def _started(placement: Placement) -> dict[str, Any]:
    return _report("job_started", placement, resumed_from_step=0, total_steps=4)


def test_only_a_report_signed_with_its_hosts_key_is_applied(
    placed: Placement, caplog: pytest.LogCaptureFixture
) -> None:
    started = _started(placed)
    altered = _signed(started)
    altered["resumed_from_step"] = 3  # changed after signing
    moved = _signed({**started, "host": "h2"})  # h1's report under h2's name, h2's key unknown
    moved["host"] = "h1"
    forged = {
        "unsigned": started,
        "h2's key": _signed(started, host="h2"),
        "altered": altered,
        "moved": moved,
        "garbled": {**started, "signature": "v1.not-hex"},
        "not a string": {**started, "signature": 7},
        "no host": _signed({k: v for k, v in started.items() if k != "host"}),
    }
    with caplog.at_level(logging.ERROR, logger="workers.tasks"):
        for name, message in forged.items():
            assert host_report(message) == "unauthenticated", name
    rejected = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(rejected) == len(forged)
    assert started["message_id"] in rejected[0]
    assert not ProcessedReport.objects.filter(message_id=started["message_id"]).exists()
    placed.refresh_from_db()
    assert placed.state == "pending"
    assert FinetuneJob.objects.get(pk=placed.job_id).status == JobStatus.QUEUED

    signed = _signed(started)
    assert host_report(signed) == "applied"
    assert host_report(signed) == "duplicate"  # a replay: the message id is applied once
    placed.refresh_from_db()
    assert placed.state == "active"
    assert FinetuneJob.objects.get(pk=placed.job_id).status == JobStatus.RUNNING


def test_commands_carry_their_hosts_signature(placed: Placement) -> None:
    send_host_command(host_name="h1", command="cancel", placement_id=placed.pk,
                      job_id=placed.job_id)  # fmt: skip
    with Connection("memory://") as connection:
        queue = host_queue_declaration("h1")(connection.default_channel)
        queue.declare()
        message = queue.get(no_ack=True)
    assert message is not None
    command = message.decode()[0][0]
    assert command["signature"].startswith("v1.")
    assert message_verify(command, host_message_key("h1"))["command"] == "cancel"
    with pytest.raises(MessageAuthError):
        message_verify(command, host_message_key("h2"))


BAD_CHECKPOINT_KEYS = [
    "",
    "/abs/checkpoints/{job}/step-000002",
    "checkpoints/{job}/step-000002/../../other",
    "checkpoints/{job}/../ftjob-other/step-000002",
    "checkpoints/{job}/step-000002//weights",
    "checkpoints/{job}/./step-000002",
    "checkpoints\\{job}\\step-000002",
    "checkpoints/{job}/step-000002\x00",
    "checkpoints/{job}/step-000003",  # another step's
    "checkpoints/ftjob-other/step-000002",  # another job's
    "checkpoints/{job}/step-0000020",  # a prefix of the key, not a segment
    "adapters/{job}",
    "C:/checkpoints/{job}/step-000002",
]


@pytest.mark.parametrize("key", BAD_CHECKPOINT_KEYS)
def test_a_checkpoint_key_outside_its_jobs_step_is_dropped(
    placed: Placement, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert host_report(_signed(_started(placed))) == "applied"
    bad = _signed(_report("checkpoint", placed, step=2, metrics={"train_loss": 1.0},
                          storage_key=key.format(job=placed.job_id)))  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="workers.tasks"):
        assert host_report(bad) == "malformed"
    assert any("malformed" in r.getMessage() and "storage_key" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert not JobCheckpoint.objects.exists()
    assert not ProcessedReport.objects.filter(message_id=bad["message_id"]).exists()
    good = _signed(_report("checkpoint", placed, step=2, metrics={"train_loss": 1.0},
                           storage_key=f"{checkpoint_key(placed.job_id, 2)}"))  # fmt: skip
    assert host_report(good) == "applied"
    assert JobCheckpoint.objects.get().path == checkpoint_key(placed.job_id, 2)


@pytest.mark.parametrize(
    "key",
    ["adapters/ftjob-other", "adapters/{job}/../ftjob-other", "adapters", "/adapters/{job}",
     "checkpoints/{job}/step-000002", "adapters/{job}x"],
)  # fmt: skip
def test_an_adapter_key_outside_its_job_is_neither_stored_nor_broadcast(
    placed: Placement, key: str, django_capture_on_commit_callbacks: Any
) -> None:
    assert host_report(_signed(_started(placed))) == "applied"
    bad = _signed(_report("job_succeeded", placed, trained_tokens=9,
                          adapter_key=key.format(job=placed.job_id)))  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        assert host_report(bad) == "malformed"
    job = FinetuneJob.objects.get(pk=placed.job_id)
    assert job.status == JobStatus.RUNNING and job.fine_tuned_model is None
    assert drain_host_queue("h1") == [] and drain_host_queue("h2") == []
    good = _signed(_report("job_succeeded", placed, trained_tokens=9,
                           adapter_key=f"{adapter_key(placed.job_id)}"))  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        assert host_report(good) == "applied"
    for name in ("h1", "h2"):
        (load,) = drain_host_queue(name)
        assert (load["command"], load["storage_key"]) == ("load_adapter", adapter_key(job.id))
    assert GpuHost.objects.count() == 2
