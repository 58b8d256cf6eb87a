"""The worker's metrics exporter, scraped for real after the tasks ran (applied as a worker
runs them, signals included): host reports by kind and outcome, task latency by task and
state, placement and reconciliation time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from api.metrics import METRIC_NAMES as WEB_METRIC_NAMES
from api.models import Deployment, FinetuneJob
from gpu_runtime.contract.message_auth import message_sign
from gpu_runtime.contract.protocol import HOST_REPORT_TASK
from tests.api.services.conftest import heartbeat, make_host, report
from tests.scrape import Samples, families, moved, parse, value
from tests.services import REDIS_URL_ENV, service_url
from workers.message_keys import host_message_key
from workers.metrics import METRIC_NAMES, exporter_start
from workers.tasks import host_report, place_job, reconcile_fleet

pytestmark = pytest.mark.django_db
TOKEN = "scrape-token-worker"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exporter() -> Iterator[str]:
    server = exporter_start(host="127.0.0.1", port=0, token=TOKEN)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def scrape(base: str) -> Samples:
    response = httpx.get(f"{base}/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text
    return parse(response.text)


def test_the_exporter_needs_its_token(exporter: str) -> None:
    assert httpx.get(f"{exporter}/metrics").status_code == 401
    wrong = httpx.get(f"{exporter}/metrics", headers={"authorization": "Bearer no"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{exporter}/other").status_code == 404
    off = exporter_start(host="127.0.0.1", port=0, token="")
    try:
        url = f"http://127.0.0.1:{off.server_address[1]}/metrics"
        assert httpx.get(url).status_code == 404
    finally:
        off.shutdown()
        off.server_close()


def test_reports_tasks_placement_and_reconcile_are_counted(
    exporter: str, deployment: Deployment, job: FinetuneJob
) -> None:
    make_host("h1", deployment)
    heartbeat("h1", harvestable_tokens_per_s=100.0)
    before = scrape(exporter)
    beat = report("heartbeat", "h1", base_model="tiny", server_url="http://h1/v1",
                  total_bytes=2**34, free_bytes=2**33, harvestable_tokens_per_s=1.0,
                  placements=[], adapters=[])  # fmt: skip
    key = host_message_key("h1")
    assert host_report.apply(args=[beat]).get() == "unauthenticated"  # unsigned
    beat = message_sign(beat, key)
    assert host_report.apply(args=[beat]).get() == "applied"
    assert host_report.apply(args=[beat]).get() == "duplicate"
    bogus = message_sign({"kind": "bogus-kind", "host": "h1"}, key)
    assert host_report.apply(args=[bogus]).get() == "malformed"
    assert place_job.apply(args=[job.id]).get() is not None
    assert place_job.apply(args=[job.id]).get() is None  # placed already
    reconcile_fleet.apply().get()
    after = scrape(exporter)

    reports = "harli_worker_host_reports_total"
    assert moved(before, after, reports, kind="heartbeat", outcome="applied") == 1
    assert moved(before, after, reports, kind="heartbeat", outcome="duplicate") == 1
    assert moved(before, after, reports, kind="?", outcome="malformed") == 1  # no new series
    assert moved(before, after, reports, kind="heartbeat", outcome="unauthenticated") == 1
    tasks = "harli_worker_task_duration_seconds_count"
    assert moved(before, after, tasks, task=HOST_REPORT_TASK, state="SUCCESS") == 4
    assert moved(before, after, tasks, task="workers.place_job", state="SUCCESS") == 2
    assert moved(before, after, tasks, task="workers.reconcile", state="SUCCESS") == 1
    placement = "harli_worker_placement_seconds_count"
    assert moved(before, after, placement, outcome="placed") == 1
    assert moved(before, after, placement, outcome="not_placed") == 1
    assert moved(before, after, "harli_worker_reconcile_seconds_count") == 1
    assert value(after, "harli_worker_reconcile_seconds_sum") > 0
    assert families(after) <= METRIC_NAMES | WEB_METRIC_NAMES  # one registry per process


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.e2e
def test_a_prefork_worker_sums_its_pool_processes_on_its_port(tmp_path: Path) -> None:
    """`celery worker` with two pool processes, PROMETHEUS_MULTIPROC_DIR and
    HARLI_WORKER_METRICS_PORT: its exporter counts the reports every pool process took."""
    redis_url = service_url(REDIS_URL_ENV)
    queue, port = f"metrics-test-{time.time_ns()}", _free_port()
    env = {**os.environ, "CELERY_BROKER_URL": redis_url,
           "DJANGO_SETTINGS_MODULE": "config.settings.test",
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "HARLI_WORKER_METRICS_PORT": str(port),
           "HARLI_METRICS_TOKEN": TOKEN}  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool", "prefork",
         "--concurrency", "2", "-Q", queue, "--hostname", f"{queue}@%h", "--loglevel",
         "WARNING", "--without-gossip", "--without-mingle"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    client = Celery("harli-test-client", broker=redis_url)
    sent = 12
    try:
        nope = message_sign({"kind": "nope", "host": "h1"}, host_message_key("h1"))
        for _ in range(sent):  # malformed: the worker drops them without the database
            client.send_task(HOST_REPORT_TASK, args=[nope], queue=queue)
        deadline, seen = time.monotonic() + 60, -1.0
        while time.monotonic() < deadline and worker.poll() is None:
            try:
                samples: Any = scrape(f"http://127.0.0.1:{port}")
            except httpx.TransportError:
                samples = {}  # the exporter is not up yet
            reports = "harli_worker_host_reports_total"
            seen = value(samples, reports, kind="?", outcome="malformed")
            if seen == sent:
                break
            time.sleep(0.2)
        assert worker.poll() is None, worker.stdout.read() if worker.stdout else ""
        assert seen == sent
        task = {"task": HOST_REPORT_TASK, "state": "SUCCESS"}
        assert value(samples, "harli_worker_task_duration_seconds_count", **task) == sent
        assert len(list(tmp_path.glob("*.db"))) >= 2  # the pool's processes wrote their own
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        client.close()
