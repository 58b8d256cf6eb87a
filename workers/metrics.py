"""Prometheus metrics of the Celery workers, and the HTTP exporter each worker serves them on.

- `harli_worker_task_duration_seconds{task, state}`: every task, timed from `task_prerun` to
  `task_postrun` (state: SUCCESS, FAILURE, RETRY, ...).
- `harli_worker_host_reports_total{kind, outcome}`: host reports taken in, by report kind and
  what applying them gave (`applied`, `duplicate`, `stale`, `unknown_host`, `malformed`, or
  `error` when applying raised).
- `harli_worker_placement_seconds{outcome}` (placed / not_placed) and
  `harli_worker_reconcile_seconds`: the placement and reconciliation services' own time.

The exporter: with HARLI_WORKER_METRICS_PORT set, a worker's main process (`worker_init`)
serves `GET /metrics` on HARLI_WORKER_METRICS_HOST (default 127.0.0.1) at that port; one port
per worker (node), so give each worker on a machine its own. Its pool's processes (prefork)
write their samples under PROMETHEUS_MULTIPROC_DIR, which the exporter sums
(`MultiProcessCollector`): without that directory only the main process's own samples are
seen, which is right for the solo and threads pools only (a warning says so). A scrape carries
`Authorization: Bearer <HARLI_METRICS_TOKEN>`, as the web process's does; without a token set
every scrape is a 404, except under `METRICS_OPEN` (local settings).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from celery import signals
from django.conf import settings
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Histogram,
)
from prometheus_client import multiprocess as prometheus_multiprocess

from gpu_runtime.contract.metrics_scrape import bearer_matches, process_exposition
from gpu_runtime.contract.protocol import REPORT_KINDS

logger = logging.getLogger(__name__)

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TASK_DURATION = Histogram(
    "harli_worker_task_duration_seconds",
    "Celery task run time, by task name and final state.",
    ["task", "state"],
    buckets=DURATION_BUCKETS_S,
)
HOST_REPORTS = Counter(
    "harli_worker_host_reports",
    "Host reports taken in, by report kind and outcome.",
    ["kind", "outcome"],
)
PLACEMENT_DURATION = Histogram(
    "harli_worker_placement_seconds",
    "Time to place one queued job, by outcome (placed, not_placed).",
    ["outcome"],
    buckets=DURATION_BUCKETS_S,
)
RECONCILE_DURATION = Histogram(
    "harli_worker_reconcile_seconds",
    "Time of one fleet reconciliation pass.",
    buckets=DURATION_BUCKETS_S,
)
METRIC_NAMES: frozenset[str] = frozenset(
    {
        "harli_worker_task_duration_seconds",
        "harli_worker_host_reports_total",
        "harli_worker_placement_seconds",
        "harli_worker_reconcile_seconds",
    }
)

_started: dict[str, float] = {}
"""perf_counter at `task_prerun`, by task id (this process's tasks in flight)."""
_started_lock = threading.Lock()


@signals.task_prerun.connect
def _task_started(task_id: str | None = None, **_: Any) -> None:
    if task_id:
        with _started_lock:
            _started[task_id] = time.perf_counter()


@signals.task_postrun.connect
def _task_finished(
    task_id: str | None = None, task: Any = None, state: str | None = None, **_: Any
) -> None:
    with _started_lock:
        started = _started.pop(task_id or "", None)
    if started is not None and task is not None:
        TASK_DURATION.labels(task.name, state or "UNKNOWN").observe(time.perf_counter() - started)


def host_report_count(kind: Any, outcome: str) -> None:
    """Count one host report; a kind the protocol does not know (a malformed report) is `?`,
    so what a host sends cannot add series."""
    HOST_REPORTS.labels(kind if kind in REPORT_KINDS else "?", outcome).inc()


@contextmanager
def timed(histogram: Histogram, **labels: str) -> Iterator[dict[str, str]]:
    """Observe the block's time in `histogram`; the block may set labels in the yielded dict."""
    chosen = dict(labels)
    started = time.perf_counter()
    try:
        yield chosen
    finally:
        elapsed = time.perf_counter() - started
        (histogram.labels(**chosen) if chosen else histogram).observe(elapsed)


def exposition() -> bytes:
    """This worker's metrics: its pool's processes' too in multiprocess mode."""
    return process_exposition(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class _Handler(BaseHTTPRequestHandler):
    token: str = ""
    open_without_token: bool = False

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            self._error(404, "Not found.", "not_found")
        elif not self.token and not self.open_without_token:
            self._error(404, "Not found.", "not_found")
        elif self.token and not bearer_matches(self.headers.get("Authorization"), self.token):
            self._error(401, "Incorrect or missing metrics token.", "invalid_api_key")
        else:
            self._send(200, exposition(), CONTENT_TYPE_LATEST)

    def _error(self, status: int, message: str, code: str) -> None:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": code}}  # fmt: skip
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the worker's log


def exporter_start(*, host: str, port: int, token: str, open_without_token: bool = False) -> (
    ThreadingHTTPServer
):  # fmt: skip
    """Serve `/metrics` on `host:port` (0: a free port, read from `server_address`) from a
    daemon thread; `shutdown()` the returned server to stop it."""
    handler = type("MetricsHandler", (_Handler,),
                   {"token": token, "open_without_token": open_without_token})  # fmt: skip
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics-exporter", daemon=True)
    thread.start()
    return server


@signals.worker_init.connect
def _start_worker_exporter(sender: Any = None, **_: Any) -> None:
    port = settings.WORKER_METRICS_PORT
    if not port:
        return
    pool = str(getattr(sender, "pool_cls", "")) if sender is not None else ""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR") and "prefork" in pool.lower():
        logger.warning("PROMETHEUS_MULTIPROC_DIR is not set: the metrics exporter sees only the "
                       "main process, not its pool's processes")  # fmt: skip
    if not settings.METRICS_TOKEN and not settings.METRICS_OPEN:
        logger.warning("HARLI_METRICS_TOKEN is not set: every scrape of the worker is a 404")
    server = exporter_start(host=settings.WORKER_METRICS_HOST, port=port,
                            token=settings.METRICS_TOKEN,
                            open_without_token=settings.METRICS_OPEN)  # fmt: skip
    logger.info("worker metrics at http://%s:%s/metrics", *server.server_address[:2])


@signals.worker_process_shutdown.connect
def _pool_process_ended(pid: int | None = None, **_: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        prometheus_multiprocess.mark_process_dead(pid or os.getpid())
