"""A web process serves at most `HARLI_WEB_REQUESTS_IN_FLIGHT` API requests at once; the rest
wait their turn and are served, not refused; the probes take no slot; each request's database
connection is closed when it ends. Unbounded, 512 clients on 4 uvicorn workers asked
PostgreSQL for more connections than its limit."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from django.db.models import QuerySet

import api.apis.files as files_api
from api.gateway.asgi import with_gateway
from api.request_slots import SlottedASGIHandler
from gpu_runtime.server.threaded import ThreadedServer

pytestmark = pytest.mark.django_db(transaction=True)

SLOTS = 2
CLIENTS = 6


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def get(port: int, path: str, key: str = "") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"authorization": f"Bearer {key}"} if key else {})
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_asgi_app_serves_django_through_slots_sized_by_the_setting() -> None:
    import config.asgi

    assert isinstance(config.asgi.django_application, SlottedASGIHandler)
    assert config.asgi.django_application.slots == settings.HARLI_WEB_REQUESTS_IN_FLIGHT


def test_requests_past_the_slots_wait_and_are_all_served(
    tenant_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    inside = 0
    most_inside = 0
    lock = threading.Lock()
    release = threading.Event()
    wrappers: list[Any] = []
    real_file_list = files_api.file_list

    def held_file_list(**kwargs: Any) -> QuerySet[Any]:
        nonlocal inside, most_inside
        with lock:
            inside += 1
            most_inside = max(most_inside, inside)
        try:
            assert release.wait(30)
            wrapper = connections["default"]  # this request thread's, opened by authentication
            assert wrapper.connection is not None
            wrappers.append(wrapper)
            return real_file_list(**kwargs)
        finally:
            with lock:
                inside -= 1

    monkeypatch.setattr(files_api, "file_list", held_file_list)
    handler = SlottedASGIHandler(SLOTS)
    server = ThreadedServer(with_gateway(handler))
    server.start()
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = [pool.submit(get, server.port, "/v1/files", tenant_key)
                       for _ in range(CLIENTS)]  # fmt: skip

            # every request arrived: SLOTS in the view, the rest waiting for a slot
            def queued() -> int:
                return len(handler.semaphore._waiters or ())

            wait_until(lambda: inside == SLOTS and queued() == CLIENTS - SLOTS,
                       "the requests to fill the slots and queue")  # fmt: skip
            assert get(server.port, "/healthz") == 200  # a probe while every slot is taken
            assert inside == SLOTS
            release.set()
            statuses = [a.result(timeout=60) for a in answers]
        assert statuses == [200] * CLIENTS
        assert most_inside == SLOTS
    finally:
        release.set()
        server.stop()
    # each request closed its connection before giving its slot back
    assert len(wrappers) == CLIENTS
    assert [w.connection for w in wrappers] == [None] * CLIENTS


def test_zero_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="slots must be >= 1"):
        SlottedASGIHandler(0)
