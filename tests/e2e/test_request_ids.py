"""End to end: a client's `X-Request-Id` appears in every process that works for its request.

The cluster logs JSON (HARLI_LOG_FORMAT=json, INFO). A job created with one id is placed by
the worker under it, the host logs its `apply_placement` under it and its reports carry it back
to the worker's intake; a cancel with another id reaches the host and comes back the same way.
An inference request's id reaches the host through the gateway.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.conftest import AGENTS, Tenants, training_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    return {"HARLI_LOG_FORMAT": "json", "HARLI_LOG_LEVEL": "INFO"}


def json_lines(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    """The JSON log objects of one process (its other lines are what it prints: Celery's
    banner, the agent's `ready` line)."""
    text = cluster.procs[name].log.read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def lines_with(cluster: Cluster, names: tuple[str, ...], request_id: str) -> list[dict[str, Any]]:
    return [
        line for name in names for line in json_lines(cluster, name)
        if line.get("request_id") == request_id
    ]  # fmt: skip


def _wait_for(cluster: Cluster, names: tuple[str, ...], request_id: str, text: str) -> None:
    wait_until(
        lambda: any(text in line["message"] for line in lines_with(cluster, names, request_id)),
        60,
        f"a line of {names} with {text!r} under {request_id}",
    )


def test_a_job_request_id_reaches_the_worker_and_the_host_and_comes_back(
    cluster: Cluster, seeded: Tenants
) -> None:
    from api.models import JobMetric

    client = OpenAI(base_url=f"{cluster.web_url}/v1", api_key=seeded.key, max_retries=0,
                    timeout=30)  # fmt: skip
    create_id = f"trace-create-{secrets.token_hex(6)}"
    upload = client.files.create(file=("train.jsonl", training_jsonl()), purpose="fine-tune")
    raw = client.fine_tuning.jobs.with_raw_response.create(
        model="tiny", training_file=upload.id, suffix="trace",
        hyperparameters={"n_epochs": 50, "batch_size": 1},
        extra_headers={"X-Request-Id": create_id},
    )  # fmt: skip
    assert raw.headers["x-request-id"] == create_id
    job = raw.parse()

    web = [line for line in json_lines(cluster, "web") if line.get("request_id") == create_id]
    assert any(
        line["logger"] == "harli.request" and line["status"] == 200 and line["tenant"] == "acme"
        for line in web
    ), web
    # the worker places it under the request's id; the host handles the command under it; the
    # host's reports about the job carry it back to the worker's intake
    _wait_for(cluster, ("worker",), create_id, "task workers.place_job")
    _wait_for(cluster, AGENTS, create_id, "handling apply_placement")
    _wait_for(cluster, ("worker",), create_id, "reported job_started: applied")
    intake = [
        line for line in lines_with(cluster, ("worker",), create_id)
        if line.get("report") == "job_started"
    ]  # fmt: skip
    assert intake[0]["job_id"] == job.id and intake[0]["level"] == "INFO"

    wait_until(lambda: JobMetric.objects.filter(job_id=job.id, step__gte=2).exists(), 60,
               "training to be under way")  # fmt: skip
    cancel_id = f"trace-cancel-{secrets.token_hex(6)}"
    cancelled = client.fine_tuning.jobs.with_raw_response.cancel(
        job.id, extra_headers={"X-Request-Id": cancel_id}
    )
    assert cancelled.headers["x-request-id"] == cancel_id
    assert any(line["job_id"] == job.id for line in lines_with(cluster, ("web",), cancel_id))
    _wait_for(cluster, AGENTS, cancel_id, "handling cancel")
    _wait_for(cluster, ("worker",), cancel_id, "reported job_stopped")


def test_an_inference_request_id_reaches_the_host(cluster: Cluster, seeded: Tenants) -> None:
    client = OpenAI(base_url=f"{cluster.web_url}/v1", api_key=seeded.key, max_retries=0,
                    timeout=30)  # fmt: skip
    request_id = f"trace-infer-{secrets.token_hex(6)}"
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="Q: hello", max_tokens=2, temperature=0,
        extra_headers={"X-Request-Id": request_id},
    )  # fmt: skip
    assert raw.headers["x-request-id"] == request_id
    routed = lines_with(cluster, ("web",), request_id)
    assert any(line["logger"] == "harli.gateway" and line["tenant"] == "acme" for line in routed)
    _wait_for(cluster, AGENTS, request_id, "POST /v1/completions 200")

    # an id a client may not choose (too long, or unsafe characters) is replaced by a fresh one
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="Q: hello", max_tokens=2, temperature=0,
        extra_headers={"X-Request-Id": "bad id;" + "x" * 200},
    )  # fmt: skip
    assert raw.headers["x-request-id"].startswith("req_")
