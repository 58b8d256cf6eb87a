"""A request's id travels with the messages it causes (`config.celery_request_ids`,
`workers.commands`): the placement task it queues carries it in its Celery headers, the task
logs under it and puts it on the host command it sends; a cancel's command carries the
cancel's; a host's report is logged by the worker's intake under the id it carries. Messages
go through the test settings' in-memory broker and are read back from it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from kombu import Connection, Queue

from api.models import Deployment, FinetuneJob, Tenant
from api.services.apikeys import api_key_issue_for_tenant
from api.services.files import UploadSource, file_create
from gpu_runtime.contract.message_auth import message_sign
from gpu_runtime.contract.protocol import CONTROL_QUEUE, ProtocolError, check_report, report
from gpu_runtime.contract.request_id import CELERY_HEADER, bound_log_context, current_request_id
from tests.api.services.conftest import LINE, drain_host_queue, heartbeat, make_host
from tests.json_logs import JsonLines, captured_json_logs
from workers.message_keys import host_message_key
from workers.tasks import host_report, place_job


@pytest.fixture
def json_logs() -> Iterator[JsonLines]:
    with captured_json_logs() as lines:
        yield lines


pytestmark = pytest.mark.django_db(transaction=True)


def drain_control_queue() -> list[Any]:
    """Every task message waiting on the control queue (headers and body)."""
    messages = []
    with Connection("memory://") as connection:
        queue = Queue(CONTROL_QUEUE)(connection.default_channel)
        queue.declare()
        while (message := queue.get(no_ack=True)) is not None:
            messages.append(message)
    return messages


@pytest.fixture
def api(tenant: Tenant, deployment: Deployment) -> Client:
    make_host("h1", deployment)
    heartbeat("h1", harvestable_tokens_per_s=100.0)
    drain_control_queue()
    client = Client()
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {api_key_issue_for_tenant(tenant=tenant).key}"
    return client


def _create_job(api: Client, tenant: Tenant, request_id: str) -> str:
    upload = UploadSource.from_bytes(filename="train.jsonl", data=LINE * 4)
    file = file_create(tenant=tenant, purpose="fine-tune", upload=upload)
    response = api.post(
        "/v1/fine_tuning/jobs",
        {"model": "tiny", "training_file": file.id},
        content_type="application/json",
        headers={"X-Request-Id": request_id},
    )
    assert response.status_code == 200 and response["x-request-id"] == request_id
    return str(response.json()["id"])


def test_a_job_request_id_rides_the_placement_task_to_the_host_command(
    api: Client, tenant: Tenant, json_logs: JsonLines
) -> None:
    job_id = _create_job(api, tenant, "create-7")
    (queued,) = [m for m in drain_control_queue() if m.headers["task"] == "workers.place_job"]
    assert queued.headers[CELERY_HEADER] == "create-7"
    assert drain_host_queue("h1") == []

    # the worker runs the task with the message's headers (inline here)
    place_job.apply(args=[job_id], headers={CELERY_HEADER: queued.headers[CELERY_HEADER]})
    (command,) = drain_host_queue("h1")
    assert command["command"] == "apply_placement" and command["request_id"] == "create-7"
    task_lines = [line for line in json_logs() if line["logger"] == "harli.tasks"]
    assert task_lines[-1]["message"].startswith("task workers.place_job ")
    assert task_lines[-1]["request_id"] == "create-7" and task_lines[-1]["job_id"] == job_id
    sent = [line for line in json_logs() if line["message"].startswith("sent apply_placement")]
    assert [line["request_id"] for line in sent] == ["create-7"]


def test_a_cancel_command_carries_the_cancel_requests_id(api: Client, tenant: Tenant) -> None:
    job_id = _create_job(api, tenant, "create-8")
    place_job.apply(args=[job_id], headers={CELERY_HEADER: "create-8"})
    (placement,) = drain_host_queue("h1")
    started = report("job_started", "h1", placement_id=placement["placement_id"], job_id=job_id,
                     resumed_from_step=0, total_steps=4, request_id="create-8")  # fmt: skip
    started = message_sign(started, host_message_key("h1"))
    assert host_report.apply(args=[started]).get() == "applied"

    response = api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel",
                        headers={"X-Request-Id": "cancel-8"})  # fmt: skip
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    (command,) = drain_host_queue("h1")
    assert command["command"] == "cancel" and command["request_id"] == "cancel-8"


def test_the_intake_logs_a_report_under_the_request_id_it_carries(
    api: Client, tenant: Tenant, json_logs: JsonLines
) -> None:
    job_id = _create_job(api, tenant, "create-9")
    place_job.apply(args=[job_id])
    (placement,) = drain_host_queue("h1")
    assert placement["request_id"] != "create-9"  # no header: the task's own id
    started = report("job_started", "h1", placement_id=placement["placement_id"], job_id=job_id,
                     resumed_from_step=0, total_steps=4, request_id="create-9")  # fmt: skip
    host_report.apply(args=[message_sign(started, host_message_key("h1"))])
    (intake,) = [line for line in json_logs() if line.get("report") == "job_started"]
    assert intake["message"] == "host h1 reported job_started: applied"
    assert intake["request_id"] == "create-9" and intake["job_id"] == job_id
    assert FinetuneJob.objects.get(pk=job_id).status == "running"


def test_a_task_run_inline_keeps_its_callers_id_and_restores_it(
    api: Client, tenant: Tenant
) -> None:
    job_id = _create_job(api, tenant, "create-10")
    with bound_log_context(request_id="caller-1"):  # eager settings: the caller's request
        place_job.apply(args=[job_id])
        assert current_request_id() == "caller-1"
    assert current_request_id() is None
    (command,) = drain_host_queue("h1")
    assert command["request_id"] == "caller-1"


@pytest.mark.parametrize("bad", ["", "two words", "x" * 129, 7, None])
def test_a_report_with_an_invalid_request_id_is_malformed(bad: object) -> None:
    message = report("heartbeat", "h1", free_bytes=1, total_bytes=2, placements=[])
    with pytest.raises(ProtocolError, match="invalid request_id"):
        check_report(message | {"request_id": bad})
