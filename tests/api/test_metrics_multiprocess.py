"""The web process under uvicorn with two worker processes and PROMETHEUS_MULTIPROC_DIR, as the
web unit runs it: one scrape of `/metrics` sums the requests every worker served."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import free_port
from tests.scrape import Samples, parse, value

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "scrape-token-multiprocess"
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_one_scrape_sums_every_uvicorn_worker(tmp_path: Path) -> None:
    from django.db import connection

    from config.database import database_url

    port, multiproc = free_port(), tmp_path / "prometheus"
    multiproc.mkdir()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test",
           "DATABASE_URL": database_url(connection.settings_dict),
           "PROMETHEUS_MULTIPROC_DIR": str(multiproc), "HARLI_METRICS_TOKEN": TOKEN,
           "HARLI_STORAGE_DIR": str(tmp_path / "storage")}  # fmt: skip
    web = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "2", "--lifespan", "on", "--no-access-log"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert web.poll() is None, web.stdout.read() if web.stdout else ""
            assert time.monotonic() < deadline, "uvicorn did not answer within 60 s"
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        # new connections each, until both workers have served some (they share the socket)
        sent, deadline = 0, time.monotonic() + 60
        while len(list(multiproc.glob("histogram_*.db"))) < 2 or sent < 20:
            assert time.monotonic() < deadline, "one uvicorn worker served every request"
            assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
            sent += 1
        samples: Samples = parse(
            httpx.get(f"{base}/metrics", headers={"authorization": f"Bearer {TOKEN}"}).text
        )
        served = value(samples, "harli_http_request_duration_seconds_count", route="/healthz",
                       method="GET", status_class="2xx")  # fmt: skip
        assert served == sent + 1  # the first probe too
        assert "harli_jobs" in samples
    finally:
        web.terminate()
        web.wait(timeout=30)
