"""`GET /metrics` of the web process through Django's test client: who may scrape it, request
latency by route and status class after real requests, job counts by status at scrape time."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from api.metrics import METRIC_NAMES
from api.models import FinetuneJob, JobStatus
from tests.api.services.conftest import job  # noqa: F401 (fixture)
from tests.scrape import Samples, families, moved, parse, value
from workers.metrics import METRIC_NAMES as WORKER_METRIC_NAMES

TOKEN = "scrape-token-web"
pytestmark = pytest.mark.django_db


def scrape(client: Client, token: str = TOKEN) -> Samples:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return parse(response.content.decode())


def test_metrics_is_off_without_a_token_and_needs_it_when_set(settings: Any) -> None:
    client = Client()
    settings.METRICS_TOKEN = ""
    off = client.get("/metrics")
    assert off.status_code == 404 and off.json()["error"]["code"] == "not_found"
    settings.METRICS_TOKEN = TOKEN
    for authorization in ("", "Bearer wrong", f"Basic {TOKEN}", TOKEN):
        refused = client.get("/metrics", HTTP_AUTHORIZATION=authorization)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    settings.METRICS_TOKEN = ""
    settings.METRICS_OPEN = True  # local settings: open on the embedded platform
    assert client.get("/metrics").status_code == 200


def test_request_latency_by_route_and_status_class(settings: Any, tenant_key: str) -> None:
    settings.METRICS_TOKEN = TOKEN
    client = Client()
    before = scrape(client)
    auth = {"authorization": f"Bearer {tenant_key}"}
    for _ in range(3):
        assert client.get("/v1/files", headers=auth).status_code == 200
    assert client.get("/v1/files/file-nope", headers=auth).status_code == 404
    assert client.get("/v1/files").status_code == 401
    assert client.get("/no/such/route").status_code == 404
    assert client.get("/healthz").status_code == 200
    after = scrape(client)
    name = "harli_http_request_duration_seconds_count"
    files = {"route": "/v1/files", "method": "GET"}
    assert moved(before, after, name, **files, status_class="2xx") == 3
    assert moved(before, after, name, **files, status_class="4xx") == 1
    one = {"route": "/v1/files/<str:file_id>", "method": "GET", "status_class": "4xx"}
    assert moved(before, after, name, **one) == 1
    assert moved(before, after, name, route="unmatched", method="GET", status_class="4xx") == 1
    assert moved(before, after, name, route="/healthz", method="GET", status_class="2xx") == 1
    bucket = "harli_http_request_duration_seconds_bucket"
    inf = {"le": "+Inf", "status_class": "2xx", **files}
    assert moved(before, after, bucket, **inf) == 3
    # one registry per process: the worker's metrics show where its tasks run (eager, locally)
    assert families(after) <= METRIC_NAMES | WORKER_METRIC_NAMES


def test_job_counts_by_status_at_scrape_time(settings: Any, job: FinetuneJob) -> None:  # noqa: F811
    settings.METRICS_TOKEN = TOKEN
    client = Client()
    counted = scrape(client)
    for status in JobStatus.values:
        expected = FinetuneJob.objects.filter(status=status).count()
        assert value(counted, "harli_jobs", status=status) == expected
    assert value(counted, "harli_jobs", status=job.status) >= 1
    FinetuneJob.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED)
    again = scrape(client)
    assert moved(counted, again, "harli_jobs", status=JobStatus.CANCELLED) == 1
    assert moved(counted, again, "harli_jobs", status=job.status) == -1
    assert "harli_hosts" in again
